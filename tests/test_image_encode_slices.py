"""An image's pass through the vision tower runs a layer at a time between the engine's steps (issue 35: it used to
stall every running sequence while it ran): a running sequence's tokens come between the encoding's slices, its
text is unchanged, and the image's tokens are the bits of a whole encode."""

from __future__ import annotations

import threading
from pathlib import Path

import numpy as np

import minfer
from minfer.runtime.engine import EngineConfig, build_engine
from minfer.runtime.engine_loop import EngineLoop
from minfer.runtime.requests import Failed, Finished, GenerationRequest, Token
from minfer.runtime.vision import MEDIA_MARKER, ImageInput

FIXTURE = Path(__file__).parent / "fixtures" / "gemma3_vision"
IMAGE = FIXTURE / "images" / "rgb_45x20.png"


def test_decoding_goes_on_between_an_images_slices():
    model = minfer.load(FIXTURE / "hf", n_ctx=256)
    prompt = model.tokenize("Once upon a time")
    want = model.complete(prompt, 40, temperature=0).tokens
    assert len(want) >= 30  # (the random fixture does not stop early: the sequence runs through the encoding)
    n_layers = model.transformer.vision.hparams.n_layer
    engine = build_engine(model.transformer, model.backend, model.tokenizer, 512, model.cache_type,
                          EngineConfig(n_slots=2, end_of_context="length"))
    loop = EngineLoop(engine)
    loop.start()
    events: list[str] = []  # in the engine thread's order: "token" and "slice"
    got: list[int] = []
    first = threading.Event()
    done = threading.Event()

    def emit(ev) -> None:
        if isinstance(ev, Token) and ev.step.token is not None:
            events.append("token")
            got.append(ev.step.token)
            first.set()
        if isinstance(ev, Finished | Failed):
            done.set()

    def traced_slices():
        slices = model.image_prompt_slices(f"{MEDIA_MARKER}What is this?", [ImageInput(IMAGE.read_bytes(), "image")],
                                           add_special=True)
        while True:
            try:
                next(slices)
            except StopIteration as end:
                events.append("end")
                return end.value
            events.append("slice")
            yield

    try:
        loop.submit([GenerationRequest(prompt, model.sampler(temperature=0), 40, emit)])
        assert first.wait(60)
        ids, placed = loop.call_in_slices(traced_slices).result(120)
        assert done.wait(120)
    finally:
        loop.stop()
    assert got == want  # the text is the one it has alone
    start = events.index("slice")
    end = events.index("end")
    # one slice per tower layer (and the patch embedding and projector around them), a decode step after each
    assert events[start:end].count("slice") >= n_layers
    assert events[start:end].count("token") >= events[start:end].count("slice") - 1
    whole_ids, whole = model.image_prompt(f"{MEDIA_MARKER}What is this?", [ImageInput(IMAGE.read_bytes(), "x")],
                                          add_special=True)
    assert ids == whole_ids and np.array_equal(placed[0].vectors, whole[0].vectors)
