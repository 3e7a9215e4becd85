"""The pieces of the speech, transcription and images endpoints that need no cluster: the
multipart parser, audio sniffing, transcript rendering, image sizes, WAV reading, and the
backends' pure helpers."""

from __future__ import annotations

import array
import io
import os
import wave

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from localai_tw.backends import backend_pb2
from localai_tw.backends.builtin import espeak_ng, hash_image, pocketsphinx_asr, wavfile
from localai_tw.frontend.api.openai import images, multipart, transcription
from localai_tw.frontend.api.openai.errors import OpenAIError
from localai_tw.frontend.api.openai.multipart import MultipartError, boundary_of, parse_form


def form(parts, boundary=b"XyZ"):
    out = b""
    for headers, data in parts:
        out += b"--" + boundary + b"\r\n" + headers + b"\r\n\r\n" + data + b"\r\n"
    return out + b"--" + boundary + b"--\r\n"


def field(name, value: bytes):
    return (b'Content-Disposition: form-data; name="' + name + b'"', value)


def filepart(data: bytes, name=b"file", filename=b"a.wav"):
    return (b'Content-Disposition: form-data; name="' + name + b'"; filename="' + filename
            + b'"\r\nContent-Type: audio/wav', data)


# -- multipart -------------------------------------------------------------------------------------


@settings(max_examples=60, deadline=None)
@given(data=st.binary(max_size=3000), value=st.text(max_size=200), chunk=st.integers(1, 97))
def test_any_file_and_field_survive_any_read_size(tmp_path_factory, data, value, chunk):
    directory = str(tmp_path_factory.mktemp("form"))
    body = form([field(b"model", value.encode()), filepart(data), field(b"x", b"1")])
    original = multipart.CHUNK
    multipart.CHUNK = chunk  # boundaries split across reads everywhere
    try:
        parsed = parse_form(io.BytesIO(body), b"XyZ", directory)
    finally:
        multipart.CHUNK = original
    assert parsed.value("model") == value and parsed.value("x") == "1"
    with open(parsed.file.path, "rb") as f:
        assert f.read() == data
    assert parsed.file.size == len(data) and parsed.file.head == data[:64]


def test_a_file_that_contains_boundary_like_bytes_is_kept_whole(tmp_path):
    data = b"--XyZ no CRLF before it\r\n--Xy\r\n-XyZ" * 50
    parsed = parse_form(io.BytesIO(form([filepart(data)])), b"XyZ", str(tmp_path))
    assert open(parsed.file.path, "rb").read() == data


@pytest.mark.parametrize("body, words", [
    (b"hello", "does not start with the boundary"),
    (b"--XyZ\r\nContent-Disposition: form-data; name=\"a\"\r\n\r\nvalue", "closing boundary"),
    (b"--XyZ\r\nno colon here\r\n\r\nv\r\n--XyZ--", "no ':'"),
    (b"--XyZ\r\nContent-Type: text/plain\r\n\r\nv\r\n--XyZ--", "Content-Disposition"),
    (b"--XyZ\r\n" + b"X-A: " + b"a" * 9000 + b"\r\n\r\nv\r\n--XyZ--", "headers"),
    (b"--XyZgarbage", "not followed by CRLF"),
])
def test_malformed_forms_say_what_is_wrong(tmp_path, body, words):
    with pytest.raises(MultipartError, match=words):
        parse_form(io.BytesIO(body), b"XyZ", str(tmp_path))


def test_fields_are_bounded_in_size_number_and_files(tmp_path):
    big = form([field(b"prompt", b"a" * (multipart.MAX_FIELD_BYTES + 1))])
    with pytest.raises(MultipartError, match="over 65536 bytes"):
        parse_form(io.BytesIO(big), b"XyZ", str(tmp_path))
    many = form([field(b"f%d" % i, b"v") for i in range(multipart.MAX_FIELDS + 2)])
    with pytest.raises(MultipartError, match="more than 64 fields"):
        parse_form(io.BytesIO(many), b"XyZ", str(tmp_path))
    two = form([filepart(b"a"), filepart(b"b")])
    with pytest.raises(MultipartError, match="more than one 'file' part"):
        parse_form(io.BytesIO(two), b"XyZ", str(tmp_path))
    elsewhere = form([filepart(b"a", name=b"audio")])
    with pytest.raises(MultipartError) as caught:
        parse_form(io.BytesIO(elsewhere), b"XyZ", str(tmp_path))
    assert caught.value.param == "file"


def test_the_clients_file_name_never_becomes_a_path(tmp_path):
    parsed = parse_form(io.BytesIO(form([filepart(b"x", filename=b"../../etc/passwd")])),
                        b"XyZ", str(tmp_path))
    assert parsed.file.path == os.path.join(str(tmp_path), "upload")
    assert os.listdir(tmp_path) == ["upload"]


@pytest.mark.parametrize("header, ok", [
    ('multipart/form-data; boundary=abc', b"abc"),
    ('multipart/form-data; boundary="a b:c"', b"a b:c"),
    ('Multipart/Form-Data;boundary=q', b"q"),
    ("application/json", None),
    ("multipart/form-data", None),
    ("multipart/form-data; boundary=" + "a" * 71, None),
    ("", None),
])
def test_boundary_of_the_content_type(header, ok):
    if ok is None:
        with pytest.raises(MultipartError):
            boundary_of(header)
    else:
        assert boundary_of(header) == ok


# -- audio and transcripts -------------------------------------------------------------------------


@pytest.mark.parametrize("head, kind", [
    (b"RIFF\x00\x00\x00\x00WAVEfmt ", "wav"), (b"fLaC\x00", "flac"), (b"OggS\x00", "ogg"),
    (b"ID3\x04", "mp3"), (b"\xff\xfb\x90", "mp3"), (b"\x00\x00\x00\x20ftypM4A ", "m4a"),
    (b"\x1a\x45\xdf\xa3", "webm"), (b"hello world", None), (b"", None), (b"RIFF1234AVI ", None),
])
def test_audio_format_from_the_first_bytes(head, kind):
    assert transcription.audio_format(head) == kind


def _result():
    words = [backend_pb2.TranscriptWord(start=0, end=500_000_000, text="one")]
    return backend_pb2.TranscriptResult(text=" one two ", language="en", duration=3.5, segments=[
        backend_pb2.TranscriptSegment(id=0, start=120_000_000, end=1_500_000_000, text="one",
                                      words=words),
        backend_pb2.TranscriptSegment(id=1, start=61_250_000_000, end=3_723_004_000_000,
                                      text=" two ")])


def test_srt_vtt_text_and_lrc():
    result = _result()
    assert transcription.render_text(result, "text") == "one two\n"
    assert transcription.render_text(result, "srt") == (
        "1\n00:00:00,120 --> 00:00:01,500\none\n\n"
        "2\n00:01:01,250 --> 01:02:03,004\ntwo\n\n")
    assert transcription.render_text(result, "vtt") == (
        "WEBVTT\n\n00:00:00.120 --> 00:00:01.500\none\n\n"
        "00:01:01.250 --> 01:02:03.004\ntwo\n\n")
    assert transcription.render_text(result, "lrc").splitlines()[2:] == [
        "[00:00.12]one", "[01:01.25]two"]
    empty = backend_pb2.TranscriptResult()
    assert transcription.render_text(empty, "vtt") == "WEBVTT\n\n"
    assert transcription.render_text(empty, "srt") == ""


def test_json_and_verbose_json_shapes():
    result = _result()
    assert transcription._json_answer(result, "json", []) == {"text": "one two"}
    verbose = transcription._json_answer(result, "verbose_json", ["word"])
    assert verbose["segments"][0] == {"id": 0, "start": 0.12, "end": 1.5, "text": "one",
                                      "tokens": []}
    assert verbose["words"] == [{"word": "one", "start": 0.0, "end": 0.5}]
    assert "words" not in transcription._json_answer(result, "verbose_json", [])


# -- images ----------------------------------------------------------------------------------------


@pytest.mark.parametrize("raw, size", [
    (None, (512, 512)), ("auto", (512, 512)), ("256x128", (256, 128)), (" 64 x 64 ", (64, 64)),
    ("2048x2048", (2048, 2048)),
])
def test_sizes(raw, size):
    assert images.parse_size(raw) == size


@pytest.mark.parametrize("raw", ["big", "0x10", "10x0", "4097x1", "4096x4096", "-1x5", "1x",
                                 512, "512x512x3", "1e3x5"])
def test_bad_sizes_are_400_naming_size(raw):
    with pytest.raises(OpenAIError) as caught:
        images.parse_size(raw)
    assert caught.value.status == 400 and caught.value.param == "size"


def test_hash_image_is_deterministic_png():
    request = backend_pb2.GenerateImageRequest(positive_prompt="a", width=5, height=3, seed=1)
    png = hash_image.png_bytes(5, 3, hash_image.seed_of(request))
    assert png == hash_image.png_bytes(5, 3, hash_image.seed_of(request))
    assert png.startswith(b"\x89PNG\r\n\x1a\n") and png[12:16] == b"IHDR"
    other = backend_pb2.GenerateImageRequest(positive_prompt="b", width=5, height=3, seed=1)
    assert hash_image.seed_of(other) != hash_image.seed_of(request)


# -- the speech backends' helpers ------------------------------------------------------------------


def _wav(path, samples, rate=8000, channels=1, width=2):
    with wave.open(str(path), "wb") as w:
        w.setnchannels(channels)
        w.setsampwidth(width)
        w.setframerate(rate)
        if width == 2:
            w.writeframes(array.array("h", samples).tobytes())
        else:
            w.writeframes(bytes(samples))


def test_wav_reading_mixes_to_mono_and_resamples(tmp_path):
    _wav(tmp_path / "s.wav", [100, 300, -100, -300], channels=2)
    samples, rate = wavfile.read_mono16(str(tmp_path / "s.wav"), 10)
    assert list(samples) == [200, -200] and rate == 8000
    assert list(wavfile.resample(array.array("h", [0, 100]), 8000, 16000)) == [0, 50, 100, 100]
    _wav(tmp_path / "b.wav", [128, 255, 0], width=1)
    assert list(wavfile.read_mono16(str(tmp_path / "b.wav"), 10)[0]) == [0, 127 << 8, -128 << 8]


def test_wav_reading_refuses_what_it_cannot_read(tmp_path):
    (tmp_path / "x.mp3").write_bytes(b"ID3" + b"\x00" * 100)
    with pytest.raises(wavfile.UnsupportedAudio, match="not a WAV"):
        wavfile.read_mono16(str(tmp_path / "x.mp3"), 10)
    _wav(tmp_path / "long.wav", [0] * 8000 * 3)
    with pytest.raises(wavfile.UnsupportedAudio, match="at most 2 s"):
        wavfile.read_mono16(str(tmp_path / "long.wav"), 2)


def test_espeak_voices_and_speed():
    listing = ("Pty Language Age/Gender VoiceName File Other\n"
               " 2  en-us  --/M  English_(America)  gmw/en-US  (en 3)\n"
               " 5  en-us  --/M  us-mbrola-2  mb/mb-us2  (en 7)\n"
               " 5  de     --/M  German  gmw/de\n")
    assert espeak_ng.parse_voices(listing) == {"en-us", "de"}
    assert espeak_ng.words_per_minute("1") == 175 and espeak_ng.words_per_minute("2") == 350
    for bad in ("0.1", "5", "fast"):
        with pytest.raises(ValueError):
            espeak_ng.words_per_minute(bad)


def test_pocketsphinx_segments_split_at_silences():
    words = [("<s>", 0, 2), ("one", 3, 20), ("<sil>", 21, 25), ("two(2)", 26, 40),
             ("<sil>", 41, 80), ("[NOISE]", 81, 82), ("three", 83, 99), ("</s>", 100, 110)]
    segments = pocketsphinx_asr.segments_of(words)
    assert [s.text for s in segments] == ["one two", "three"]
    assert segments[0].start == 30_000_000 and segments[0].end == 410_000_000
    assert [w.text for w in segments[0].words] == ["one", "two"]
    assert [s.id for s in segments] == [0, 1]
