"""``rtc.negotiated_codecs``: which codec an SDP answer settled on, per media section (pure text)."""

from cadence.serve.rtc import negotiated_codecs

ANSWER = """v=0\r
o=- 1 1 IN IP4 127.0.0.1\r
s=-\r
t=0 0\r
m=video 9 UDP/TLS/RTP/SAVPF 101 102\r
a=rtpmap:102 VP8/90000\r
a=rtpmap:101 H264/90000\r
a=fmtp:101 packetization-mode=1\r
m=audio 9 UDP/TLS/RTP/SAVPF 96 0\r
a=rtpmap:96 opus/48000/2\r
a=rtpmap:0 PCMU/8000\r
"""


def test_first_payload_type_of_each_section_named_by_its_rtpmap():
    assert negotiated_codecs(ANSWER) == {
        "video": "H264",
        "audio": "opus",
    }  # the m= order, not the rtpmap order
    assert negotiated_codecs(ANSWER.replace("101 102", "102 101")) == {"video": "VP8", "audio": "opus"}


def test_sections_without_a_named_payload_are_left_out():
    assert negotiated_codecs("v=0\r\nm=video 9 UDP/TLS/RTP/SAVPF 97\r\na=rtpmap:96 VP8/90000\r\n") == {}
    assert negotiated_codecs("m=video 0 UDP/TLS/RTP/SAVPF\r\n") == {}
    assert negotiated_codecs("") == {}


def test_the_schemas_sdp_pattern_is_the_servers_own_check_and_aiortcs_parser_errors_are_400():
    """Issue 30: POST /sessions with ``sdp=0`` was a 400 for a string the schema allowed. The ``sdp`` field's
    pattern is now the check the server makes first (one predicate), and an offer aiortc's parser refuses
    with an AssertionError (found by schemathesis once the pattern let it through) is a 400, not a 500."""
    import re

    import pytest

    pytest.importorskip("aiortc")
    from cadence.devtools.testing import offer_sdp
    from cadence.serve.guard import SDP_PATTERN, ApiError, check_sdp

    ok = offer_sdp()
    cases = {
        ok: True,
        "0": False,
        "v=0\r\nm=video 9 UDP/TLS/RTP/SAVPF 96\r\na=fingerprint:sha-256 AB\r\n": True,
        "v=0\r\na=fingerprint:sha-256 AB\r\nm=video 9 UDP/TLS/RTP/SAVPF 96\r\n": True,  # either order
        "v=0\r\nm=audio 9 UDP/TLS/RTP/SAVPF 96\r\na=fingerprint:sha-256 AB\r\n": False,  # no video
        "v=0\r\nm=video 9 UDP/TLS/RTP/SAVPF 96\r\n": False,  # no fingerprint
        " v=0\nm=video\n  a=fingerprint:x": True,
        "x\nv=0\nm=video\na=fingerprint:x": False,
        "v=0\nm=video\na=fingerprint:x\0": False,
    }
    for sdp, allowed in cases.items():
        assert bool(re.match(SDP_PATTERN, sdp)) is allowed, sdp  # (ECMA-262 reads these constructs alike)
        if not allowed:  # outside the schema: refused by the check the pattern states
            with pytest.raises(ApiError) as e:
                check_sdp(sdp, "offer", 65536)
            assert e.value.status == 400, sdp
    check_sdp(ok, "offer", 65536)  # a real offer passes
    with pytest.raises(ApiError) as e:  # matches the pattern, but aiortc's parser asserts on its m= line
        check_sdp("v=0\nm=video\na=fingerprint:", "offer", 65536)
    assert e.value.status == 400 and "malformed SDP offer" in e.value.message
