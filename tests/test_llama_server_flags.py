"""llama-server's command line on ``minfer serve`` (:mod:`minfer.cli.llama_server_flags`): every flag of llama-server
is in the table, and each is parsed (as minfer's own flag, an alias of one, or accepted without effect) or refused
with one line naming it; a flag in neither is argparse's usual error. The server-wide defaults and names run against
a real server in ``test_llama_server_defaults.py``."""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest

from minfer.cli import build_parser
from minfer.cli.llama_server_flags import FLAGS, by_spelling

LLAMA_SERVER_SPELLINGS = sorted(
    line.strip() for line in (Path(__file__).parent / "data" / "llama_server_flags.txt").read_text().splitlines()
    if line.strip() and not line.startswith("#"))


def serve_parser() -> argparse.ArgumentParser:
    parser = build_parser()
    return parser._subparsers._group_actions[0].choices["serve"]  # type: ignore[union-attr]


def sample_value(action: argparse.Action) -> list[str]:
    """A value the flag's own parser takes (a choice, a number, a word), as many as it consumes."""
    if action.nargs == 0:
        return []
    if action.choices:
        value = str(next(iter(action.choices)))
    elif action.type in (int, float):
        value = "1"
    else:
        value = "x"
    return [value] * (action.nargs if isinstance(action.nargs, int) else 1)


def test_the_table_covers_every_llama_server_flag_once():
    spellings = [s for flag in FLAGS for s in flag.spellings]
    assert len(spellings) == len(set(spellings)), "a spelling is in the table twice"
    assert set(spellings) == set(LLAMA_SERVER_SPELLINGS)


@pytest.mark.parametrize("spelling", LLAMA_SERVER_SPELLINGS)
def test_each_flag_is_parsed_or_refused_by_name(spelling, capsys):
    flag = by_spelling()[spelling]
    parser = serve_parser()
    action = parser._option_string_actions.get(spelling)
    assert action is not None, f"{spelling} is neither parsed nor refused"
    if spelling in ("-h", "--help", "--usage"):
        with pytest.raises(SystemExit) as e:
            parser.parse_args([spelling])
        assert e.value.code == 0 and "llama-server's flags" in capsys.readouterr().out
        return
    argv = [spelling, *sample_value(action)]
    if type(action).__name__ == "_Refuse":
        assert flag.action == "refused"
        with pytest.raises(SystemExit) as e:
            parser.parse_args(argv)
        err = capsys.readouterr().err
        assert e.value.code == 2
        assert err.count("\n") == 1 and err.startswith(f"minfer serve: error: {spelling}: ") and flag.why in err
        return
    # parsed: minfer's own flag (a table entry marked refused may since be implemented by minfer itself)
    parser.parse_args(argv)
    assert capsys.readouterr().err == ""


def test_a_flag_in_neither_is_argparses_error(capsys):
    with pytest.raises(SystemExit) as e:
        build_parser().parse_args(["serve", "--no-such-flag"])
    assert e.value.code == 2 and "unrecognized arguments: --no-such-flag" in capsys.readouterr().err


def test_help_lists_the_accepted_spellings_and_hides_the_refused(capsys):
    with pytest.raises(SystemExit):
        serve_parser().parse_args(["--help"])
    out = " ".join(capsys.readouterr().out.split())  # argparse wraps lines
    for spelling in ("-ngl", "--n-gpu-layers", "-ctk", "--cache-type-k", "-cram", "--n-predict", "--temp", "-mm",
                     "--no-webui", "--log-disable", "--model-draft", "--rerank", "--log-verbose", "--typical-p"):
        assert f"{spelling}" in out, spelling
    assert "-ctk --cache-type-k -ctv --cache-type-v: minfer's --cache-type sets K and V alike" in out
    assert "--rope-scaling" not in out  # refused: not offered


@pytest.mark.parametrize(("argv", "dest", "value"), [
    (["-ctk", "f16"], "cache_type", "f16"),
    (["-ub", "64"], "batch_size", 64),
    (["-cram", "100"], "cache_ram", 100),
    (["-a", "x,y"], "alias", "x,y"),
    (["--rerank"], "pooling", "rank"),
    (["--log-disable"], "log_format", "off"),
    (["--no-webui"], "ui", False),
    (["--no-slots"], "slots", False),
    (["-md", "draft.gguf"], "draft", "draft.gguf"),
    (["--draft-n", "5"], "draft_max", 5),
    (["-m", "model.gguf"], "model_option", "model.gguf"),
    (["-n", "7"], "n_predict", 7),
    (["--temp", "0.3"], "temperature", 0.3),
    (["-s", "42"], "seed", 42),
    (["-ngl", "99"], "model", None),  # accepted, no effect
])
def test_mapped_flags_set_minfers_option(argv, dest, value):
    args = build_parser().parse_args(["serve", *argv])
    assert getattr(args, dest) == value


def test_model_given_twice_is_an_error(tmp_path):
    from minfer.cli import main

    assert main(["serve", "a.gguf", "-m", "b.gguf"]) == 1


def test_bad_server_defaults_stop_the_server_before_loading():
    from minfer.errors import BadRequestError
    from minfer.server import ServeOptions, serve

    with pytest.raises(BadRequestError, match="server sampling defaults"):
        serve(ServeOptions(model="no-such-model.gguf", sampling_defaults={"top_p": 7.0}))
    with pytest.raises(BadRequestError, match="-n/--n-predict"):
        serve(ServeOptions(model="no-such-model.gguf", n_predict=-5))


def test_server_wide_flags_are_refused_with_several_models():
    from minfer.errors import BadRequestError
    from minfer.server import ServeOptions, serve_models

    with pytest.raises(BadRequestError, match="--n-predict"):
        serve_models(ServeOptions(n_predict=5), ["a.gguf", "b.gguf"], None, 2)


# -- the server-wide settings, on a real server (the tiny llama fixture: its text does not matter) ----------------

TEMPLATE = ("{% if enable_thinking is defined %}[think={{ enable_thinking }}]{% endif %}"
            "{% if reasoning_effort is defined %}[effort={{ reasoning_effort }}]{% endif %}"
            "{% if custom is defined %}[custom={{ custom }}]{% endif %}"
            "{% for m in messages %}<{{ m.role }}>{{ m.content }}{% endfor %}"
            "{% if add_generation_prompt %}>{% endif %}")


@pytest.fixture(scope="module")
def configured(tmp_path_factory):
    from conftest import fixture_dir

    from minfer.testing.server_process import ServerProcess

    template = tmp_path_factory.mktemp("template") / "chat.jinja"
    template.write_text(TEMPLATE)
    args = ["-t", "1", "--ctx-size", "256", "--parallel", "2", "--host", "127.0.0.1,127.0.0.2",
            "--alias", "zeta,alpha", "--tags", "t2,t1", "--temp", "1.5", "--seed", "42", "--top-k", "7",
            "-n", "5", "--no-ui", "--verbose", "--chat-template-file", str(template), "-ngl", "99",
            "--chat-template-kwargs", '{"custom": "x", "enable_thinking": true}', "--reasoning", "off",
            "--reasoning-effort", "low"]
    with ServerProcess(fixture_dir("llama") / "model-f32.gguf", args) as s:
        yield s


@pytest.mark.slow
def test_props_show_the_server_defaults(configured):
    """llama-server -n 5 --temp 1.5 --seed 42 --top-k 7: /props default_generation_settings.params has n_predict 5,
    temperature 1.5, top_k 7 and seed 42 (4294967295 only without --seed); ui false with --no-ui."""
    import httpx

    props = httpx.get(configured.url + "/props", timeout=30).json()
    params = props["default_generation_settings"]["params"]
    assert (params["n_predict"], params["temperature"], params["top_k"], params["seed"]) == (5, 1.5, 7, 42)
    assert props["ui"] is False and props["model_alias"] == "alpha"
    assert props["chat_template"] == TEMPLATE
    # llama-server's other settings, as it shows them with no draft model: fixed in minfer
    assert params["speculative.types"] == "none" and params["max_tokens"] == 5 and params["dynatemp_range"] == 0.0
    assert props["endpoint_slots"] is True and props["modalities"]["video"] is False


@pytest.mark.slow
def test_slots_are_on_by_default_with_llama_servers_fields(configured):
    """llama-server answers /slots without --slots (its default is on); each slot has n_prompt_tokens and a list
    next_token."""
    import httpx

    slots = httpx.get(configured.url + "/slots", timeout=30).json()
    assert len(slots) == 2 and all(isinstance(s["next_token"], list) and s["n_prompt_tokens"] == 0 for s in slots)


@pytest.mark.slow
def test_requests_get_the_server_defaults(configured):
    """A request without n_predict stops at -n's 5 tokens; without a seed it samples with --seed's 42, so two
    answers at --temp 1.5 are the same; its own fields still win."""
    import httpx

    def complete(**body):
        return httpx.post(configured.url + "/completion", json={"prompt": "hello", "ignore_eos": True, **body},
                          timeout=60).json()

    first, second = complete(), complete()
    assert first["tokens_predicted"] == 5 and first["content"] == second["content"]
    assert first["generation_settings"]["seed"] == 42 and first["generation_settings"]["temperature"] == 1.5
    own = complete(n_predict=3, temperature=0.0)
    assert own["tokens_predicted"] == 3 and own["generation_settings"]["temperature"] == 0.0
    chat = httpx.post(configured.url + "/v1/chat/completions", timeout=60,
                      json={"messages": [{"role": "user", "content": "hi"}]}).json()
    assert chat["usage"]["completion_tokens"] <= 5


@pytest.mark.slow
def test_models_list_aliases_and_tags(configured):
    """llama-server --alias zeta,alpha --tags t2,t1: /v1/models data[0] has id alpha (the first of the sorted set),
    aliases [alpha, zeta], tags [t1, t2]; a request may name either alias."""
    import httpx

    card = httpx.get(configured.url + "/v1/models", timeout=30).json()["data"][0]
    assert (card["id"], card["aliases"], card["tags"]) == ("alpha", ["alpha", "zeta"], ["t1", "t2"])
    assert card["meta"]["n_ctx"] == httpx.get(configured.url + "/props", timeout=30).json()["n_ctx"]
    assert httpx.get(configured.url + "/v1/models/zeta", timeout=30).status_code == 200


@pytest.mark.slow
def test_no_ui_serves_no_page_and_every_host_answers(configured):
    """--no-ui: / is a 404 (llama-server's answer too); --host 127.0.0.1,127.0.0.2: both addresses, one port."""
    import httpx

    assert httpx.get(configured.url + "/", timeout=30).status_code == 404
    other = configured.url.replace("127.0.0.1", "127.0.0.2")
    assert other != configured.url and httpx.get(other + "/health", timeout=30).status_code == 200


@pytest.mark.slow
def test_verbose_answers_carry_the_native_answer(configured):
    """llama-server -v: a chat answer's __verbose is its native /completion answer, with the rendered prompt
    (here from --chat-template-file)."""
    import httpx

    chat = httpx.post(configured.url + "/v1/chat/completions", timeout=60,
                      json={"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}).json()
    verbose = chat["__verbose"]
    assert verbose["prompt"].endswith("<user>hi>") and verbose["tokens_predicted"] == chat["usage"]["completion_tokens"]
    assert verbose["content"] == chat["choices"][0]["message"]["content"]
    cmpl = httpx.post(configured.url + "/v1/completions", json={"prompt": "hi", "max_tokens": 2}, timeout=60).json()
    assert cmpl["__verbose"]["content"] == cmpl["choices"][0]["text"]


def test_the_chat_templates_variables_default_to_the_servers(configured):
    """llama-server's --chat-template-kwargs, then --reasoning off (enable_thinking false, over the kwargs' true) and
    --reasoning-effort: every render gets them (the prompt of /apply-template and of a chat answer), and a
    request's own chat_template_kwargs win."""
    import httpx

    hi = [{"role": "user", "content": "hi"}]
    default = httpx.post(configured.url + "/apply-template", json={"messages": hi}, timeout=60).json()["prompt"]
    assert default == "[think=False][effort=low][custom=x]<user>hi>"
    chat = httpx.post(configured.url + "/v1/chat/completions", json={"messages": hi, "max_tokens": 1},
                      timeout=60).json()
    assert chat["__verbose"]["prompt"] == default
    own = httpx.post(configured.url + "/apply-template", timeout=60,
                     json={"messages": hi, "chat_template_kwargs": {"enable_thinking": True, "custom": "y"}})
    assert own.json()["prompt"] == "[think=True][effort=low][custom=y]<user>hi>"


@pytest.mark.parametrize(("flags", "error"), [
    (["--reasoning", "maybe"], "--reasoning must be on, off or auto"),
    (["--reasoning-budget", "100"], "--reasoning-budget 100: minfer has no thinking budget"),
    (["--chat-template-kwargs", "{oops"], "--chat-template-kwargs is not valid JSON"),
    (["--chat-template-kwargs", "[1]"], "--chat-template-kwargs must be a JSON object"),
    (["--media-path", "/no/such/folder"], "--media-path '/no/such/folder' is not a folder"),
])
def test_bad_template_flags_are_one_line_errors(flags, error):
    import subprocess
    import sys

    r = subprocess.run([sys.executable, "-m", "minfer", "serve", "no-such-model.gguf", *flags], capture_output=True,
                       text=True, timeout=120)
    assert r.returncode != 0 and error in r.stderr and "Traceback" not in r.stderr
