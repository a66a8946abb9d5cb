"""Sample transforms on real data: a sentencepiece model trained here, JPEG/PNG bytes written by pillow.

Expected values come from sentencepiece and pillow directly (ids, decoded text, a pillow-resized
reference image), never from the transform under test.
"""

from __future__ import annotations

import io
import math
import pickle

import numpy as np
import pytest
import sentencepiece as spm
import torch
from PIL import Image, ImageOps

import torchdata_overlord as ol
from torchdata_overlord import testing
from torchdata_overlord.transforms import ImageText, Tokenize

# torchvision 0.29 deprecates its decoders in favour of torchcodec (not a dependency here); the brief uses them.
pytestmark = pytest.mark.filterwarnings("ignore:The image decoding and encoding capabilities:DeprecationWarning")

PATCH, MAX_SIDE = 14, 448
CLOSE = 3  # mean abs difference (0-255) allowed against pillow; a blank or mirrored image is off by > 30
SIZES = [(640, 480), (480, 640), (1000, 300), (300, 1000), (448, 448), (100, 60), (2000, 20), (449, 10),
         (14, 14), (5, 3), (3, 5)]  # (width, height)


@pytest.fixture(scope="session")
def spm_model(tmp_path_factory):
    texts = testing.make_text_corpus(2000, seed=0)
    return testing.train_sentencepiece(texts, tmp_path_factory.mktemp("spm") / "tok", vocab_size=256)


@pytest.fixture(scope="session")
def sp(spm_model):
    return spm.SentencePieceProcessor(model_file=spm_model)


def norm(text: str) -> str:
    return " ".join(text.split())


def pillow_reference(data: bytes, height: int, width: int) -> torch.Tensor:
    """What the image should look like: pillow decode, upright, RGB, bilinear resize to the same size."""
    img = ImageOps.exif_transpose(Image.open(io.BytesIO(data))).convert("RGB")
    img = img.resize((width, height), Image.BILINEAR)
    return torch.from_numpy(np.asarray(img).copy()).permute(2, 0, 1)


def expected_scale(w: int, h: int) -> float:
    return min(1.0, MAX_SIDE / max(w, h))


# --- test data helpers -------------------------------------------------------------------------------------------

def test_corpus_is_seeded_and_bounded():
    corpus = lambda seed: testing.make_text_corpus(50, seed=seed, min_words=4, max_words=9)  # noqa: E731
    a, b = corpus(3), corpus(3)
    assert a == b and a != corpus(4)
    assert all(4 <= len(t.split()) <= 9 and t.endswith(".") and t[0].isupper() for t in a)


@pytest.mark.parametrize("fmt", ["JPEG", "PNG"])
def test_image_bytes_are_real_images(fmt):
    data = testing.make_image_bytes(37, 21, fmt, seed=5)
    assert data == testing.make_image_bytes(37, 21, fmt, seed=5)
    img = Image.open(io.BytesIO(data))
    assert img.format == fmt and img.size == (37, 21)
    assert np.asarray(img.convert("RGB")).std() > 5


# --- Tokenize ----------------------------------------------------------------------------------------------------

def test_token_ids_round_trip(spm_model, sp):
    tok = Tokenize(spm_model)
    assert tok.columns == ("text",)
    for text in testing.make_text_corpus(50, seed=11):  # held-out sentences
        out = tok({"text": text})
        ids = out["input_ids"]
        assert ids.dtype == torch.int64 and ids.dim() == 1 and out["tokens"] == len(ids)
        assert ids.tolist() == [sp.bos_id()] + sp.encode(text) + [sp.eos_id()]
        assert norm(sp.decode(ids.tolist())) == norm(text)
        assert out["truncated"] is False


@pytest.mark.parametrize("bos,eos", [(True, True), (True, False), (False, True), (False, False)])
def test_bos_eos_as_configured(spm_model, sp, bos, eos):
    text = "The loader reads the source and the planner makes a plan."
    ids = Tokenize(spm_model, add_bos=bos, add_eos=eos)({"text": text})["input_ids"].tolist()
    body = sp.encode(text)
    assert ids == [1] * bos + body + [2] * eos
    assert ids.count(1) == bos and ids.count(2) == eos


def test_max_tokens_truncates_and_says_so(spm_model, sp):
    text = testing.make_text_corpus(1, seed=2, min_words=60, max_words=60)[0]
    full = [1] + sp.encode(text) + [2]
    out = Tokenize(spm_model, max_tokens=16)({"text": text})
    assert out["input_ids"].tolist() == full[:16] and out["tokens"] == 16 and out["truncated"] is True
    short = Tokenize(spm_model, max_tokens=len(full))({"text": text})
    assert short["input_ids"].tolist() == full and short["truncated"] is False
    with pytest.raises(ValueError, match="max_tokens"):
        Tokenize(spm_model, max_tokens=0)


def test_tokenize_pickles_and_copy_matches(spm_model):
    tok = Tokenize(spm_model, field="content", max_tokens=40)
    text = testing.make_text_corpus(1, seed=9, min_words=30, max_words=30)[0]
    before = tok({"content": text})  # processor loaded: pickling must still work and not carry it
    blob = pickle.dumps(tok)
    copy = pickle.loads(blob)
    after = copy({"content": text})
    assert torch.equal(before["input_ids"], after["input_ids"])
    assert before["tokens"] == after["tokens"] and before["truncated"] == after["truncated"]
    assert len(blob) < 2000  # the path travels, not the model


def test_missing_or_bad_field_is_named(spm_model):
    tok = Tokenize(spm_model, field="text")
    with pytest.raises(KeyError, match=r"'text'.*available fields: \['body', 'id'\]") as err:
        tok({"body": "x", "id": 1})
    assert isinstance(err.value, ValueError)
    with pytest.raises(TypeError, match="'text'.*bytes"):
        tok({"text": b"bytes, not str"})
    with pytest.raises(TypeError, match="'text'.*None"):
        tok({"text": None})
    with pytest.raises(FileNotFoundError, match="no-such"):
        Tokenize("/no-such/model.model")


# --- ImageText ---------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("fmt", ["JPEG", "PNG"])
@pytest.mark.parametrize("w,h", SIZES)
def test_image_text_geometry_and_pixels(spm_model, sp, fmt, w, h):
    data = testing.make_image_bytes(w, h, fmt, seed=w * 7 + h)
    text = "A small red car by the river."
    out = ImageText(spm_model, patch=PATCH, max_side=MAX_SIDE)({"image": data, "text": text})
    px = out["pixels"]
    assert px.dtype == torch.uint8 and px.dim() == 3 and px.shape[0] == 3
    H, W = px.shape[1:]
    assert H % PATCH == 0 and W % PATCH == 0 and H >= PATCH and W >= PATCH and max(H, W) <= MAX_SIDE
    assert out["grid"] == (H // PATCH, W // PATCH)
    assert out["patches"] == math.prod(out["grid"]) and out["image_patches"] == [out["patches"]]
    s = expected_scale(w, h)
    assert abs(H - h * s) <= PATCH and abs(W - w * s) <= PATCH  # aspect ratio kept within one patch
    assert out["orig_size"] == (h, w)
    assert out["input_ids"].tolist() == [1] + sp.encode(text) + [2] and out["tokens"] == len(out["input_ids"])
    assert px.unique().numel() > 1  # not a blank image
    ref = pillow_reference(data, H, W)
    assert (px.float() - ref.float()).abs().mean() < CLOSE


@pytest.mark.parametrize("mode", ["L", "RGBA", "P", "LA"])
def test_png_modes_become_rgb(spm_model, mode):
    data = testing.make_image_bytes(60, 40, "PNG", seed=1, mode=mode)
    out = ImageText(spm_model)({"image": data, "text": "x"})
    assert out["pixels"].shape == (3, 42, 56)
    assert (out["pixels"].float() - pillow_reference(data, 42, 56).float()).abs().mean() < CLOSE


def test_sixteen_bit_png_is_scaled_to_uint8(spm_model):
    gray16 = (np.linspace(0, 65535, 56 * 28).reshape(28, 56)).astype(np.uint16)
    buf = io.BytesIO()
    Image.fromarray(gray16).save(buf, "PNG")
    px = ImageText(spm_model)({"image": buf.getvalue(), "text": "x"})["pixels"]
    assert px.dtype == torch.uint8 and px.shape == (3, 28, 56)
    assert (px[0].float() - torch.from_numpy(gray16 >> 8).float()).abs().mean() < 2


@pytest.mark.parametrize("fmt", ["BMP", "TIFF"])
def test_pillow_fallback_for_formats_torchvision_lacks(spm_model, fmt):
    data = testing.make_image_bytes(90, 50, fmt, seed=4)
    from torchvision.io import decode_image
    with pytest.raises(RuntimeError):  # so the pillow path is really the one under test
        decode_image(torch.frombuffer(bytearray(data), dtype=torch.uint8))
    px = ImageText(spm_model)({"image": data, "text": "x"})["pixels"]
    assert px.shape == (3, 56, 84)
    assert (px.float() - pillow_reference(data, 56, 84).float()).abs().mean() < CLOSE


def test_exif_orientation_is_applied(spm_model):
    img = Image.fromarray(testing.make_pixels(140, 70, seed=2))
    exif = img.getexif()
    exif[0x0112] = 6  # rotate 90 degrees clockwise on display
    buf = io.BytesIO()
    img.save(buf, "JPEG", exif=exif, quality=95)
    out = ImageText(spm_model)({"image": buf.getvalue(), "text": "x"})
    assert out["orig_size"] == (140, 70) and out["pixels"].shape == (3, 140, 70)
    assert (out["pixels"].float() - pillow_reference(buf.getvalue(), 140, 70).float()).abs().mean() < CLOSE


def test_exif_orientation_is_applied_to_webp_too(spm_model):
    """torchvision's WebP decoder ignores EXIF: a rotated WebP came out unrotated while JPEG and PNG were rotated."""
    img = Image.fromarray(testing.make_pixels(140, 70, seed=2))
    exif = img.getexif()
    exif[0x0112] = 6
    buf = io.BytesIO()
    img.save(buf, "WEBP", exif=exif, lossless=True)
    out = ImageText(spm_model)({"image": buf.getvalue(), "text": "x"})
    assert out["orig_size"] == (140, 70) and out["pixels"].shape == (3, 140, 70)
    assert (out["pixels"].float() - pillow_reference(buf.getvalue(), 140, 70).float()).abs().mean() < CLOSE


def test_an_animated_gif_gives_its_first_frame(spm_model):
    """torchvision decodes every frame of a GIF: the 4-D tensor reached the batch as one image's pixels, its
    grid counting one frame's patches."""
    frames = [Image.fromarray(testing.make_pixels(56, 28, seed=s)).convert("P") for s in (5, 6, 7)]
    buf = io.BytesIO()
    frames[0].save(buf, "GIF", save_all=True, append_images=frames[1:], duration=100, loop=0)
    out = ImageText(spm_model, patch=14)({"image": buf.getvalue(), "text": "x"})
    assert out["pixels"].shape == (3, 28, 56) and out["patches"] == 8
    first = torch.from_numpy(np.asarray(frames[0].convert("RGB")).copy()).permute(2, 0, 1)
    assert torch.equal(out["pixels"], first)


def test_min_side_upscales_but_max_side_wins(spm_model):
    up = ImageText(spm_model, min_side=112)({"image": testing.make_image_bytes(40, 20, "PNG"), "text": "x"})
    assert up["pixels"].shape == (3, 112, 224)
    long = ImageText(spm_model, min_side=112)({"image": testing.make_image_bytes(1000, 10, "PNG"), "text": "x"})
    assert long["pixels"].shape == (3, 14, 448)


@pytest.mark.parametrize("bad", [b"not an image at all" * 4, b"",
                                 testing.make_image_bytes(64, 48, "JPEG")[:300],
                                 testing.make_image_bytes(64, 48, "PNG")[:120]],
                         ids=["garbage", "empty", "truncated-jpeg", "truncated-png"])
def test_corrupt_image_raises_value_error(spm_model, bad):
    with pytest.raises(ValueError, match="'image'.*could not be decoded by torchvision or pillow"):
        ImageText(spm_model)({"image": bad, "text": "x"})


def _header_cases():
    """Images in every layout the header reader knows, at random sizes: (name, bytes, (width, height))."""
    rng = np.random.default_rng(7)
    out = []
    for k in range(6):
        w, h = (int(x) for x in rng.integers(1, 700, 2))
        img = Image.fromarray(testing.make_pixels(w, h, seed=k))
        exif = img.getexif()
        exif[0x0112] = 6
        for name, kw in [("PNG", {}), ("JPEG", {}), ("JPEG", {"progressive": True}), ("JPEG", {"exif": exif}),
                         ("GIF", {}), ("WEBP", {}), ("WEBP", {"lossless": True}), ("WEBP", {"exif": exif})]:
            buf = io.BytesIO()
            img.save(buf, name, **kw)
            out.append((f"{name}{kw and '-' + '-'.join(kw)}-{w}x{h}", buf.getvalue(), (w, h)))
    return out


def test_image_header_size_matches_pillow_for_every_layout():
    from torchdata_overlord.transforms.image_header import image_size

    for name, raw, size in _header_cases():
        assert Image.open(io.BytesIO(raw)).size == size, name
        assert image_size(raw) == size, name
    assert image_size(b"BM" + bytes(60)) is None and image_size(b"\xff\xd8\xff") is None


def _png_header_only(width: int, height: int) -> bytes:
    """A PNG signature and IHDR chunk (valid CRC) claiming ``width`` x ``height``, then IEND: no pixel data."""
    import struct
    import zlib

    def chunk(kind: bytes, body: bytes) -> bytes:
        return struct.pack(">I", len(body)) + kind + body + struct.pack(">I", zlib.crc32(kind + body))

    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)) + \
        chunk(b"IEND", b"")


def test_a_decompression_bomb_is_refused_before_decoding(spm_model):
    """A small file whose header claims more pixels than max_pixels fails its row without being decoded: a
    30,000 x 30,000 PNG of 850 KiB decoded to 3.3 GB of RSS here."""
    with pytest.raises(ol.transforms.ImageDecodeError, match="100000 x 100000 .* over max_pixels=89,478,485"):
        ImageText(spm_model)({"image": _png_header_only(100_000, 100_000), "text": "x"})
    small = testing.make_image_bytes(64, 48, "JPEG")
    with pytest.raises(ValueError, match="64 x 48 = 3,072 pixels .* over max_pixels=3,000"):
        ImageText(spm_model, max_pixels=3000)({"image": small, "text": "x"})
    assert ImageText(spm_model, max_pixels=3072)({"image": small, "text": "x"})["orig_size"] == (48, 64)
    assert ImageText(spm_model, max_pixels=None)({"image": small, "text": "x"})["orig_size"] == (48, 64)
    for bad in (0, -1, 2.5, True):
        with pytest.raises(ol.ConfigError, match="max_pixels"):
            ImageText(spm_model, max_pixels=bad)
    assert "max_pixels" not in repr(ImageText(spm_model))
    assert "max_pixels=3000" in repr(ImageText(spm_model, max_pixels=3000))


def test_image_text_missing_fields_and_config(spm_model):
    it = ImageText(spm_model, image_field="jpg", text_field="caption")
    assert it.columns == ("jpg", "caption")
    with pytest.raises(KeyError, match=r"'jpg'.*\['caption', 'image'\]"):
        it({"image": b"", "caption": "x"})
    with pytest.raises(KeyError, match="'caption'"):
        it({"jpg": b""})
    with pytest.raises(TypeError, match="'jpg'.*None"):
        it({"jpg": None, "caption": "x"})
    with pytest.raises(ValueError, match="patch"):
        ImageText(spm_model, patch=16, max_side=8)


def test_image_text_pickles_and_copy_matches(spm_model):
    it = ImageText(spm_model, patch=16, max_side=256, max_tokens=8)
    row = {"image": testing.make_image_bytes(300, 200, "JPEG", seed=8), "text": "A blue river at night, a long story."}
    a = it(row)
    b = pickle.loads(pickle.dumps(it))(row)
    assert torch.equal(a["pixels"], b["pixels"]) and torch.equal(a["input_ids"], b["input_ids"])
    assert {k: v for k, v in a.items() if k not in ("pixels", "input_ids")} == \
        {k: v for k, v in b.items() if k not in ("pixels", "input_ids")}
    assert a["truncated"] is True and a["tokens"] == 8


def test_outputs_feed_the_planner_metadata(spm_model):
    it = ImageText(spm_model)
    rows = testing.make_caption_rows(4, seed=1, max_side=300)
    outs = [{"index": i, **it(r)} for i, r in enumerate(rows)]
    meta = ol.BufferMeta.from_samples("caps", outs)
    assert meta.patches.tolist() == [o["patches"] for o in outs]
    assert meta.tokens.tolist() == [o["tokens"] for o in outs] and meta.num_images.tolist() == [1] * 4


def test_hugging_face_image_structs_read_from_parquet(spm_model, tmp_path):
    """A Hugging Face ``datasets`` Image column in Parquet is a struct ``{bytes, path}``: the bytes when
    embedded, else the file at the path. Both decode to what the plain bytes give; neither is an error
    naming the field."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    from torchdata_overlord.transforms.image_text import ImageDecodeError

    images = [testing.make_image_bytes(120 + 20 * i, 90, "JPEG", seed=i) for i in range(3)]
    (tmp_path / "on_disk.jpg").write_bytes(images[2])
    structs = [{"bytes": images[0], "path": "a.jpg"}, {"bytes": images[1], "path": None},
               {"bytes": None, "path": str(tmp_path / "on_disk.jpg")}]
    pq.write_table(pa.table({"image": structs, "text": ["one", "two", "three"]}), tmp_path / "hf.parquet")
    it = ImageText(spm_model)
    src = ol.ParquetSource("hf", str(tmp_path / "hf.parquet"), it, seed=0)
    got = {}
    for _ in range(3):
        index, row, where = src.next_raw()
        got[index] = src.apply(row, where)
    assert sorted(got) == [0, 1, 2]
    for i, image in enumerate(images):
        want = it({"image": image, "text": ["one", "two", "three"][i]})
        assert torch.equal(got[i]["pixels"], want["pixels"]) and torch.equal(got[i]["input_ids"], want["input_ids"])
    with pytest.raises(TypeError, match=r"'image' is a struct with fields \['path'\].*'bytes' or 'path'"):
        it({"image": {"path": None}, "text": "x"})
    with pytest.raises(ImageDecodeError, match=r"'image' holds no bytes, and its path '/nonexistent/x.jpg' cannot be "
                                               r"read.*embed_external_files"):
        it({"image": {"bytes": None, "path": "/nonexistent/x.jpg"}, "text": "x"})
