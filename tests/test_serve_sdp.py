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
