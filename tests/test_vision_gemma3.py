"""Gemma 3 with its vision tower (tests/fixtures/gemma3_vision: transformers' random Gemma3ForConditionalGeneration):
the image tokens and the logits at every position of prompts holding one and two images, against transformers."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

import minfer
from minfer.errors import MinferError
from minfer.models.model import TransformerModel
from minfer.runtime.vision import PassImage, VisionRunner

FIXTURE = Path(__file__).parent / "fixtures" / "gemma3_vision"
TOL = 1e-4  # DESIGN.md: logits within 1e-4 of transformers at every position of a prompt holding images


def case(k: int) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Prompt ``k``'s token ids, pixels, transformers' image tokens and logits."""
    return tuple(np.load(FIXTURE / f"{name}_{k}.npy")  # type: ignore[return-value]
                 for name in ("input_ids", "pixel_values", "image_features", "logits"))


def image_starts(ids: np.ndarray, image_token: int) -> list[int]:
    is_image = ids == image_token
    return [i for i in range(len(ids)) if is_image[i] and (i == 0 or not is_image[i - 1])]


@pytest.mark.parametrize("kernels", ["fast", "reference"])
@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("k", [0, 1])
def test_logits_of_prompts_with_images_match_transformers(k, threads, kernels):
    model = minfer.load(FIXTURE / "hf", n_ctx=256, threads=threads, kernels=kernels)
    vision = model.transformer.vision
    ids, pixels, features_ref, logits_ref = case(k)
    features = VisionRunner(vision, model.backend).encode(list(pixels))
    assert features.shape == features_ref.shape
    assert float(np.abs(features - features_ref).max()) <= 1e-5
    starts = image_starts(ids, vision.hparams.image_token_id)
    assert len(starts) == len(pixels)
    images = [PassImage(s, f) for s, f in zip(starts, features, strict=True)]
    logits = model.runner.forward(ids, np.arange(len(ids)), images=images)
    assert float(np.abs(logits - logits_ref).max()) <= TOL


def test_an_image_seen_causally_would_not_match():
    """The image's rows attend to each other both ways: the same pass with every row's keys ending at its own
    position (what the kernel did before) is far from transformers, so the test above can fail."""
    model = minfer.load(FIXTURE / "hf", n_ctx=256)
    ids, pixels, _, logits_ref = case(0)
    features = VisionRunner(model.transformer.vision, model.backend).encode(list(pixels))
    start = image_starts(ids, model.transformer.vision.hparams.image_token_id)[0]
    # the image's 16 tokens as 16 one-row "images": each sees only up to itself
    one_by_one = [PassImage(start + i, features[0, i:i + 1]) for i in range(features.shape[1])]
    causal = model.runner.forward(ids, np.arange(len(ids)), images=one_by_one)
    assert float(np.abs(causal - logits_ref).max()) > 0.1
    assert float(np.abs(causal - np.load(FIXTURE / "logits_causal_0.npy")).max()) <= TOL


def test_a_prompt_in_chunks_that_keep_each_image_whole_equals_one_pass():
    model = minfer.load(FIXTURE / "hf", n_ctx=256)
    ids, pixels, _, logits_ref = case(1)
    features = VisionRunner(model.transformer.vision, model.backend).encode(list(pixels))
    starts = image_starts(ids, model.transformer.vision.hparams.image_token_id)
    cuts = [0, starts[0] - 1, starts[0] + 16 + 3, starts[1], len(ids)]  # the second image opens a chunk
    got = []
    for a, b in zip(cuts, cuts[1:], strict=False):
        images = [PassImage(s - a, f) for s, f in zip(starts, features, strict=True) if a <= s < b]
        got.append(model.runner.forward(ids[a:b], np.arange(a, b), images=images))
    assert float(np.abs(np.concatenate(got) - logits_ref).max()) <= TOL


def test_an_image_batch_gives_each_image_its_own_bits():
    model = minfer.load(FIXTURE / "hf", n_ctx=64)
    runner = VisionRunner(model.transformer.vision, model.backend)
    pixels = np.load(FIXTURE / "pixel_values_1.npy")
    both = runner.encode(list(pixels))
    assert np.array_equal(both[1], runner.encode([pixels[1]])[0])
    assert runner.images_encoded == 3


def test_the_text_model_alone_is_unchanged_by_the_image_inputs():
    """A vision-language model's text rows keep their token's embedding bit for bit (x * 1 + 0)."""
    ids = np.load(FIXTURE / "input_ids_0.npy")[:8]  # before the image
    model = minfer.load(FIXTURE / "hf", n_ctx=64)
    with_inputs = model.runner.forward(ids, np.arange(len(ids)))
    ref = np.load(FIXTURE / "logits_0.npy")[:8]
    assert float(np.abs(with_inputs - ref).max()) <= TOL


def _folder_with(tmp_path: Path, edit) -> Path:
    out = tmp_path / "hf"
    shutil.copytree(FIXTURE / "hf", out)
    cfg = json.loads((out / "config.json").read_text())
    edit(cfg)
    (out / "config.json").write_text(json.dumps(cfg))
    return out


@pytest.mark.parametrize("edit, message", [
    (lambda c: c["vision_config"].update(patch_size=5), "patch_size"),
    (lambda c: c.update(mm_tokens_per_image=15), "mm_tokens_per_image 15"),
    (lambda c: c["vision_config"].update(hidden_act="relu"), "vision_config.hidden_act"),
    (lambda c: c["vision_config"].update(num_hidden_layers=1), "v.blk.1"),
    (lambda c: c["vision_config"].update(hidden_size=48), "has shape"),
    (lambda c: c.pop("vision_config") and c.update(vision_config="x"), "vision_config"),
    (lambda c: c.update(architectures=["Gemma3ForCausalLM"]), "Gemma3ForConditionalGeneration"),
])
def test_a_bad_vision_config_is_one_line_naming_the_field(tmp_path, edit, message):
    with pytest.raises(MinferError) as err:
        TransformerModel.from_path(_folder_with(tmp_path, edit))
    text = str(err.value)
    assert message in text and "\n" not in text


def test_a_projector_for_another_text_width_is_refused(tmp_path):
    from safetensors.numpy import load_file, save_file

    out = _folder_with(tmp_path, lambda c: None)
    tensors = load_file(out / "model.safetensors")
    tensors["multi_modal_projector.mm_input_projection_weight"] = np.zeros((32, 48), np.float32)
    save_file(tensors, out / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(MinferError, match="mm_input_projection_weight.*text model's embedding width"):
        TransformerModel.from_path(out)


# -- images in chat messages, through the engine ------------------------------------------------------------


def messages_of(k: int, as_data_urls: bool = False) -> list[dict]:
    """Prompt ``k``'s messages with its images as file paths (the Python API) or data: URLs (what servers get)."""
    import base64

    p = json.loads((FIXTURE / f"prompt_{k}.json").read_text())
    names = iter(p["images"])
    out = []
    for m in p["messages"]:
        parts = []
        for part in m["content"]:
            if part["type"] != "image":
                parts.append(part)
                continue
            path = FIXTURE / "images" / next(names)
            if as_data_urls:
                url = "data:image/png;base64," + base64.b64encode(path.read_bytes()).decode()
                parts.append({"type": "image_url", "image_url": {"url": url}})
            else:
                parts.append({"type": "image", "path": str(path)})
        out.append({"role": m["role"], "content": parts})
    return out


@pytest.fixture(scope="module")
def vlm():
    return minfer.load(FIXTURE / "hf", n_ctx=256)


@pytest.mark.parametrize("k", [0, 1])
def test_chat_prompt_ids_equal_the_hf_processors(vlm, k):
    from minfer.runtime.vision import extract_images

    messages, images = extract_images(messages_of(k, as_data_urls=k == 1), allow_paths=True)
    ids, placed = vlm.image_prompt(vlm.render_chat(messages), images)
    ref = np.load(FIXTURE / f"input_ids_{k}.npy")
    image_token = vlm.transformer.vision.hparams.image_token_id
    assert [p.first for p in placed] == image_starts(ref, image_token)
    for p in placed:  # an image's rows carry its own id, the same for the same pixels
        assert len(set(ids[p.first:p.end])) == 1 and ids[p.first] < 0
        ids[p.first:p.end] = [image_token] * (p.end - p.first)
    assert ids == ref.tolist()


def test_greedy_chat_with_images_equals_greedy_decoding_of_transformers_logits(vlm):
    """The engine's greedy reply equals the one step-by-step forward passes give, and its first token is the argmax of
    transformers' logits at the prompt's last position."""
    ids, pixels, _, logits_ref = case(1)
    features = VisionRunner(vlm.transformer.vision, vlm.backend).encode(list(pixels))
    starts = image_starts(ids, vlm.transformer.vision.hparams.image_token_id)
    reply = vlm.chat(messages_of(1), max_tokens=6, temperature=0)
    got = vlm.last_stats.tokens
    assert got[0] == int(np.argmax(logits_ref[-1]))
    seq, images, want = list(ids), [PassImage(s, f) for s, f in zip(starts, features, strict=True)], []
    logits = vlm.runner.forward(seq, np.arange(len(seq)), output_rows=[len(seq) - 1], seq_ids=0, images=images)
    for _ in range(6):
        want.append(int(np.argmax(logits[-1])))
        logits = vlm.runner.forward([want[-1]], [len(seq) + len(want) - 1], seq_ids=0)
    assert got == want[:len(got)] and reply == vlm.detokenize(got)


def test_a_follow_up_turn_reuses_the_images_cells_and_does_not_encode_it_again(vlm):
    rows: list[int] = []
    forward = vlm.runner.forward

    def counting(tokens, *args, **kwargs):
        rows.append(len(tokens))
        return forward(tokens, *args, **kwargs)

    first = messages_of(0)
    vlm.chat(first, max_tokens=3, temperature=0)
    encoded = vlm.images.runner.images_encoded
    follow_up = [*first, {"role": "assistant", "content": "A picture."}, {"role": "user", "content": "Describe it."}]
    vlm.runner.forward = counting
    try:
        vlm.chat(follow_up, max_tokens=2, temperature=0)
    finally:
        vlm.runner.forward = forward
    assert vlm.images.runner.images_encoded == encoded
    n_prompt = vlm.last_stats.prompt_tokens
    assert rows[0] < n_prompt - 24  # the image (rows 8..23) and what came before it came from the cache


def test_another_image_in_the_same_place_is_not_taken_from_the_cache(vlm):
    """Prompts that differ only in their image's pixels have different ids at its rows: the cache gives back only what
    precedes the image."""
    first = messages_of(0)
    vlm.chat(first, max_tokens=1, temperature=0)
    other = json.loads(json.dumps(first))
    other[0]["content"][0]["path"] = str(FIXTURE / "images" / "rgb_64x64.png")
    alone = minfer.load(FIXTURE / "hf", n_ctx=256)
    assert vlm.chat(other, max_tokens=4, temperature=0) == alone.chat(other, max_tokens=4, temperature=0)
    assert vlm.last_stats.tokens == alone.last_stats.tokens


def test_a_small_batch_size_evaluates_each_image_whole(tmp_path):
    """Passes of at most 20 tokens: the prompt is cut before each image, and each image (16 tokens) runs in one pass,
    so the reply equals the one of a single prompt pass."""
    from minfer.api import Model
    from minfer.runtime.engine import EngineConfig

    small = Model(FIXTURE / "hf", n_ctx=256, engine_config=EngineConfig(batch_size=20))
    passes: list[tuple[int, list]] = []
    forward = small.runner.forward

    def spy(tokens, positions, *args, images=(), **kwargs):
        passes.append((int(np.asarray(positions)[0]), [(p.first, p.end) for p in images]))
        return forward(tokens, positions, *args, images=images, **kwargs)

    small.runner.forward = spy
    got = small.chat(messages_of(1), max_tokens=5, temperature=0)
    whole = minfer.load(FIXTURE / "hf", n_ctx=256).chat(messages_of(1), max_tokens=5, temperature=0)
    assert got == whole
    starts = [36, 68]
    assert sorted(first + pos for pos, imgs in passes for first, _ in imgs) == starts
    assert all(end - first == 16 for _, imgs in passes for first, end in imgs)


@pytest.mark.parametrize("part, message", [
    ({"type": "image_url", "image_url": {"url": "https://example.com/cat.png"}}, "remote image URLs are not fetched"),
    ({"type": "image_url", "image_url": {"url": "data:image/png;base64,@@@"}}, "is not valid base64"),
    ({"type": "image_url", "image_url": {"url": "data:image/png;base64,aGVsbG8="}}, "messages[0].content[0]"),
    ({"type": "image"}, "an image part needs"),
])
def test_bad_image_parts_are_one_line_naming_the_part(vlm, part, message):
    with pytest.raises(MinferError) as err:
        vlm.chat([{"role": "user", "content": [part, {"type": "text", "text": "What is it?"}]}], max_tokens=1)
    assert message in str(err.value) and "\n" not in str(err.value)


def test_a_text_model_refuses_images():
    model = minfer.load(Path(__file__).parent / "fixtures" / "gemma3" / "model-f32.gguf", n_ctx=64)
    with pytest.raises(MinferError, match="takes no images"):
        model.chat(messages_of(0), max_tokens=1)


# -- the command line and conversations ---------------------------------------------------------------------


def minfer_cli(*args: str, stdin: str = "") -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "minfer", *args], input=stdin, capture_output=True, text=True,
                          timeout=300)


IMAGE = FIXTURE / "images" / "rgb_45x20.png"


@pytest.mark.parametrize("model_args", [[str(FIXTURE / "hf")],
                                        [str(FIXTURE / "gguf" / "model-f32.gguf"), "--mmproj",
                                         str(FIXTURE / "gguf" / "mmproj-f32.gguf")]])
def test_minfer_run_with_an_image_answers_as_the_api(model_args):
    r = minfer_cli("run", *model_args, "--image", str(IMAGE), "What is in this image?", "-n", "8", "--temp", "0",
                   "-q")
    assert r.returncode == 0, r.stderr
    model = minfer.load(model_args[0], n_ctx=256, mmproj=model_args[2] if len(model_args) > 1 else None)
    want = model.chat([{"role": "user", "content": [{"type": "image", "path": str(IMAGE)},
                                                    {"type": "text", "text": "What is in this image?"}]}],
                      max_tokens=8, temperature=0)
    assert r.stdout == want + "\n"


def test_minfer_run_names_a_bad_image_file_in_one_line(tmp_path):
    bad = tmp_path / "notes.png"
    bad.write_text("not an image")
    r = minfer_cli("run", str(FIXTURE / "hf"), "--image", str(bad), "Hi", "-n", "2")
    assert r.returncode != 0 and "Traceback" not in r.stderr
    assert str(bad) in r.stderr and len(r.stderr.strip().splitlines()) == 1


def test_chat_image_command_shows_the_image_with_the_next_message(vlm):
    r = minfer_cli("chat", str(FIXTURE / "hf"), "-n", "6", "--temp", "0",
                   stdin=f"/image {IMAGE}\nWhat is in this image?\nAnd the colours?\n")
    assert r.returncode == 0, r.stderr
    conv = vlm.conversation(temperature=0)
    from minfer.runtime.vision import ImageInput

    first = conv.send("What is in this image?", 6, images=[ImageInput(IMAGE.read_bytes(), str(IMAGE))])
    second = conv.send("And the colours?", 6)
    assert r.stdout == f"{first}\n{second}\n"
    with pytest.raises(MinferError, match="cannot be saved"):
        conv.save(Path("/tmp") / "never-written.session")
