"""The command line: one-line errors with exit code 2, help, models, prepare, and the elastic launcher."""

import json
import math
import os
import resource
import signal
import subprocess
import sys
import time
import typing
from pathlib import Path

import pytest

from paratrain.cli import build_parser, main
from paratrain.commands.options import config_from_args
from paratrain.config import ConfigError, iter_options
from paratrain.metrics import read_metrics
from paratrain.models import MODEL_CONFIGS

SMALL = ["--n-layers", "2", "--dim", "64", "--n-heads", "4", "--n-kv-heads", "2", "--ffn-dim", "128",
         "--seq-len", "32", "--global-batch", "8", "--micro-batch", "4", "--eval-batches", "2",
         "--sample-tokens", "8", "--no-progress"]


def paratrain(*argv, timeout=120):
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    return subprocess.run([sys.executable, "-m", "paratrain", *argv], capture_output=True, text=True,
                          timeout=timeout, env=env)


@pytest.mark.parametrize("argv, message", [
    (["--model", "gpt5"], "unknown model 'gpt5'"),
    (["--steps", "-3"], "--steps must be at least 1"),
    (["--data", "/no/such/corpus"], "/no/such/corpus"),
    (["--global-batch", "10", "--micro-batch", "4"], "--global-batch 10 is not divisible"),
    (["--nproc", "3", "--global-batch", "8", "--micro-batch", "1"], "--global-batch 8 is not divisible"),
    (["--dim", "30"], "dim=30"),
    (["--seq-len", "4096"], "exceeds the model's max_seq_len"),
    (["--stepz", "3"], "unrecognized arguments: --stepz"),
    (["--lr", "fast"], "--lr: expected float"),
    (["--nproc", "2", "--dp", "3"], "pp × dp × tp = 1 × 3 × 1 = 3 but the world has 2 process(es)"),
    (["--nproc", "4", "--tp", "8"], "world size 4 is not divisible by tp × pp = 8 × 1"),
    (["--nproc", "2", "--tp", "2", "--n-kv-heads", "1"], "kv heads 1 not divisible by tp 2"),
    (["--nproc", "2", "--tp", "2", "--ffn-dim", "687"], "ffn 687 not divisible by tp 2"),
    (["--sequence-parallel"], "--sequence-parallel needs tensor parallelism (--tp > 1)"),
    (["--nproc", "2", "--pp", "2", "--zero", "3"], "--zero 3 with --pp 2 is refused"),
    (["--nproc", "2", "--pp", "2", "--schedule", "zigzag"], "--schedule: 'zigzag' is not one of"),
    (["--nproc", "2", "--pp", "2", "--virtual-stages", "2"], "--virtual-stages 2 needs --schedule interleaved"),
    (["--nproc", "2", "--pp", "2", "--schedule", "interleaved"], "--schedule interleaved needs --virtual-stages 2"),
    (["--nproc", "2", "--pp", "2", "--schedule", "interleaved", "--virtual-stages", "2", "--global-batch", "12",
      "--micro-batch", "4"], "needs the micro-batches per step (3) divisible by --pp 2"),
    (["--nproc", "2", "--pp", "2", "--schedule", "interleaved", "--virtual-stages", "2", "--n-layers", "6",
      "--global-batch", "8", "--micro-batch", "4"], "layers 6 not divisible by --pp × --virtual-stages = 2 × 2"),
    (["--nproc", "4", "--pp", "4", "--n-layers", "2"], "layers 2 not divisible by pp 4"),
    (["--nproc", "2", "--tp", "2", "--sequence-parallel", "--seq-len", "63"], "--seq-len 63 is not divisible by --tp 2"),
    (["--nproc", "2", "--cp", "2", "--seq-len", "30"], "--seq-len 30 is not divisible by 2 × --cp = 4"),
    (["--nproc", "4", "--cp", "2", "--dp-shard", "1", "--zero", "3"], "--cp 2 with --dp-shard 1 is not supported yet"),
    (["--zero", "4"], "--zero: 4 is not one of [0, 1, 2, 3]"),
    (["--precision", "fp8"], "--precision: 'fp8' is not one of"),
    (["--keep-latest", "1"], "--keep-latest 1: keep at least 2 checkpoints"),
    (["--resume", "/no/such/step-00000004"], "/no/such/step-00000004 is not a checkpoint directory"),
    (["--resume", "none", "--load-step", "4"], "--load-step picks a checkpoint of the run in --out"),
    (["--nan-policy", "ignore"], "--nan-policy: 'ignore' is not one of"),
    (["--pg-timeout", "0"], "--pg-timeout must be positive seconds"),
    (["--pg-timeout", "1e300"], "--pg-timeout must be positive seconds up to 604800 (a week)"),
    (["--lr", "nan"], "--lr: expected a finite number, got nan"),
    (["--lr", "inf"], "--lr: expected a finite number, got inf"),
    (["--micro-batch", "0"], "--micro-batch must be at least 1, got 0"),
    (["--checkpoint-every", "-1"], "--checkpoint-every must not be negative, got -1"),
    (["--tp", "-1"], "--tp must be at least 1, got -1"),
    (["--nproc", "2.5"], "--nproc: expected int, got '2.5'"),
    (["--nproc", "two"], "--nproc: expected int, got 'two'"),
    (["--seed", "-1"], "--seed must not be negative, got -1"),
    (["--out", "{tmp}/occupied"], "--out {tmp}/occupied is a file, not a directory"),
    (["--out", "{tmp}/occupied/run"], "--out {tmp}/occupied/run: {tmp}/occupied is a file, so no directory"),
    (["--out", "/sys/paratrain-run"], "--out /sys/paratrain-run: cannot write in /sys (Permission denied)"),
    (["--config", "{tmp}/malformed.toml"], "--config {tmp}/malformed.toml: invalid TOML (Expected ']'"),
    (["--config", "{tmp}/mistyped.toml"], "train.lr: expected float, got 'fast'"),
    (["--config", "{tmp}/list.toml"], "data.path: expected str, got ['a.txt']"),
    (["--config", "{tmp}/not-a-table.toml"], "train = 3 is not a table"),
    (["--config", "{tmp}"], "is a directory, not a file; pass a TOML file"),
    (["--data", "{tmp}/empty.txt"], "--data {tmp}/empty.txt is empty (1 file(s)): one training and one evaluation"),
    (["--tokenizer", "{tmp}/tokenizer.json"], "tokenizer file '{tmp}/tokenizer.json' is not a valid tokenizer.json"),
    (["--nproc", "2", "--micro-batch", "8", "--tokenizer", "{tmp}/tokenizer.json"], "is not a valid tokenizer.json"),
    (["--mem-budget", "1kB"], "exceeds its budget of 1 kB (--mem-budget); choose a layout that fits"),
    (["--mem-budget", "lots"], "--mem-budget 'lots' is not a memory size"),
    (["--model", "llama2-70b", "--nproc", "64", "--global-batch", "64", "--micro-batch", "1"],
     "the planner's memory estimate for one process, 1.12 TB (params 276 GB, grads 276 GB, optimizer state 552 GB"),
    (["--step-timeout", "-1"], "--step-timeout must be positive seconds up to 604800 (a week) (or 0: no watchdog)"),
    (["--nnodes", "2"], "--nnodes 2 needs --rdzv-endpoint HOST:PORT and --rdzv-id ID"),
    (["--snapshot-every", "-1"], "--snapshot-every must not be negative, got -1"),
    (["--snapshot-buddy", "next-door"], "--snapshot-buddy 'next-door': expected next-node or next-rank, or a map"),
    (["--snapshot-buddy", "0:1,1:0"], "--snapshot-buddy '0:1,1:0': it pairs 2 rank(s), the job has 1"),
    (["--straggler-steps", "0"], "--straggler-steps must be at least 1, got 0"),
    (["--straggler-threshold", "0"], "--straggler-threshold must be a positive fraction of the median (0.2: 20%)"),
    (["--rdzv-endpoint", "somewhere"], "--rdzv-endpoint 'somewhere' is not HOST:PORT"),
    (["--join-timeout", "0"], "--join-timeout must be positive seconds"),
    (["--node-timeout", "2"], "--node-timeout must be whole seconds from 3 (a heartbeat a second)"),
    (["--vocab-size", "100"], "the tokenizer has 259 tokens but model 'tiny' only 100"),
    (["--data", ":0.5"], "(a mixture is WEIGHT:SOURCE for every source"),
    # The batch left to its defaults is resolved again for another dp: the nearest layout is offered, not a batch
    # the user never set blamed.
    (["--nproc", "3", "--tp", "3", "--n-heads", "8", "--n-kv-heads", "4"],
     "heads 8 not divisible by tp 3; nearest valid layouts: dp=3 tp=1 pp=1"),
    (["--init-from", "{tmp}/no-such-model"], "--init-from"),
])
def test_bad_input_is_one_line_and_exit_2(argv, message, capsys, tmp_path):
    bad_inputs(tmp_path)
    argv, message = [a.format(tmp=tmp_path) for a in argv], message.format(tmp=tmp_path)
    code = exit_code(["train", "--out", str(tmp_path / "run"), *argv])
    err = capsys.readouterr().err
    assert code == 2
    assert message in err
    assert len(err.strip().splitlines()) == 1, err
    assert "Traceback" not in err
    assert not (tmp_path / "run").exists(), "nothing may be written before validation passes"


def bad_inputs(directory: Path) -> None:
    """The files the bad-input table names: a file where a directory belongs, broken configs, corpus, tokenizer."""
    (directory / "occupied").write_text("a file\n")
    (directory / "malformed.toml").write_text("[train\nsteps = 3\n")
    (directory / "mistyped.toml").write_text('[train]\nlr = "fast"\n')
    (directory / "list.toml").write_text('[data]\npath = ["a.txt"]\n')
    (directory / "not-a-table.toml").write_text("train = 3\n")
    (directory / "empty.txt").write_text("")
    (directory / "tokenizer.json").write_text('{"model": {"type": "BPE", "vocab": ')


@pytest.mark.parametrize("flag", [flag for section, cls, f, flag in iter_options()
                                  if typing.get_type_hints(cls)[f.name] in (float, float | None)])
def test_every_real_valued_option_refuses_nan_and_inf(flag, capsys, tmp_path):
    for value in ("nan", "inf", "-inf"):
        assert exit_code(["train", "--out", str(tmp_path / "run"), f"{flag}={value}"]) == 2
        err = capsys.readouterr().err
        assert err == f"paratrain train: error: {flag}: expected a finite number, got {float(value)}\n", err


def test_no_mem_check_starts_a_run_over_its_memory_budget(tmp_path):
    from paratrain.run.build import preflight

    argv = ["train", "--mem-budget", "1kB", "--out", str(tmp_path / "run")]
    with pytest.raises(ConfigError, match="exceeds its budget of 1 kB"):
        preflight(config_from_args(build_parser().parse_args(argv)), 1)
    preflight(config_from_args(build_parser().parse_args([*argv, "--no-mem-check"])), 1)


def exit_code(argv) -> int:
    """main()'s exit code, whether it returns it or argparse exits with it."""
    try:
        return main(argv)
    except SystemExit as e:
        return e.code


@pytest.mark.single_process
def test_bad_input_from_a_real_process_has_no_traceback(tmp_path):
    result = paratrain("train", "--model", "nope", timeout=60)
    assert result.returncode == 2
    assert result.stderr.strip() == ("paratrain train: error: unknown model 'nope'; choose one of: "
                                     + ", ".join(MODEL_CONFIGS))
    bad_inputs(tmp_path)  # found before the launcher starts a worker, which would fail on each attempt
    result = paratrain("train", "--nproc", "2", "--micro-batch", "8", "--max-restarts", "2",
                       "--data", str(tmp_path / "empty.txt"),
                       "--out", str(tmp_path / "run"), timeout=60)
    assert result.returncode == 2
    assert result.stderr.startswith(f"paratrain train: error: --data {tmp_path / 'empty.txt'} is empty") \
        and result.stderr.count("\n") == 1, result.stderr
    assert not (tmp_path / "run").exists()


@pytest.mark.single_process
@pytest.mark.parametrize("case", ["occupied out", "tokenizer larger than the model", "layout"])
def test_a_launch_refuses_in_the_launching_process_before_any_rank_starts(case, tmp_path):
    """Exit 2 with one line, within seconds of the command, nothing written into --out: the refusals a worker would
    otherwise make after the launch (and leave run.json behind). The worker server the command started goes with
    the refusal: stopped mid-preload and reaped by the command, its processor time counts below."""
    out = tmp_path / "run"
    argv = {"occupied out": [], "tokenizer larger than the model": ["--vocab-size", "100"],
            "layout": ["--tp", "3"]}[case]
    if case == "occupied out":
        out.mkdir()
        (out / "run.json").write_text('{"run_id": "earlier"}\n')
        (out / "metrics.jsonl").write_text('{"step": 1}\n')
    before = sorted((p.name, p.read_text()) for p in out.iterdir()) if out.exists() else None
    # The processor time of the command and of the server it reaped, not the wall time: on a loaded machine (this
    # suite's peers) the wall time measures the load; on an idle one the two agree. Each imports torch once (~3 s
    # of one core); a launch that went ahead would add its workers' start, their failure and the restarts.
    used = resource.getrusage(resource.RUSAGE_CHILDREN)
    result = paratrain("train", "--nproc", "2", "--steps", "2", "--out", str(out), *argv, *SMALL, timeout=120)
    now = resource.getrusage(resource.RUSAGE_CHILDREN)
    elapsed = now.ru_utime + now.ru_stime - used.ru_utime - used.ru_stime
    assert result.returncode == 2 and result.stderr.startswith("paratrain train: error: "), result.stderr
    assert result.stderr.count("\n") == 1 and "rank" not in result.stderr, result.stderr
    assert (sorted((p.name, p.read_text()) for p in out.iterdir()) if out.exists() else None) == before
    assert elapsed < 9, f"refused after {elapsed:.1f} s of processor time"


def test_help_documents_every_option(capsys):
    with pytest.raises(SystemExit):
        main(["train", "--help"])
    text = capsys.readouterr().out
    for _, _, f, flag in iter_options():
        assert flag in text, flag
        assert f.metadata["help"].split()[0] in text


def test_models_json_lists_exact_counts(capsys):
    assert main(["models", "--json"]) == 0
    rows = {r["name"]: r["parameters"] for r in json.loads(capsys.readouterr().out)}
    assert rows["llama2-7b"] == 6_738_415_616
    assert rows == {name: cfg.num_params() for name, cfg in MODEL_CONFIGS.items()}


def test_models_shows_each_models_recipe(capsys):
    """`paratrain models` prints the optimizer and schedule each named model trains with by default."""
    from paratrain.models import get_recipe

    assert main(["models"]) == 0
    lines = capsys.readouterr().out.splitlines()
    header = lines[0].split()
    for column in ("lr", "min_lr", "warmup", "beta2", "eps", "wd", "clip"):
        assert column in header, column
    table = lines[1:lines.index("")]  # the recipes' sources follow the table
    rows = {line.split()[0]: line.split() for line in table}
    assert set(rows) == set(MODEL_CONFIGS)
    for name, row in rows.items():
        recipe = get_recipe(name)
        values = dict(zip(header, row))
        assert float(values["lr"]) == recipe.lr and int(values["warmup"].replace(",", "")) == recipe.warmup_steps
        assert float(values["beta2"]) == recipe.beta2 and float(values["eps"]) == recipe.eps
    assert main(["models", "--json"]) == 0
    documents = {r["name"]: r for r in json.loads(capsys.readouterr().out)}
    assert documents["llama2-7b"]["recipe"]["lr"] == get_recipe("llama2-7b").lr == 3e-4


def test_prepare_then_train_on_it(tmp_path, capsys):
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    for i in range(3):
        (corpus / f"doc{i}.txt").write_text(("the quick brown fox jumps over the lazy dog %d\n" % i) * 400)
    assert main(["prepare", "--data", str(corpus), "--out", str(tmp_path / "tokens")]) == 0
    assert (tmp_path / "tokens" / "tokens.bin").is_file()
    assert main(["train", "--data", str(tmp_path / "tokens"), "--steps", "3", "--out", str(tmp_path / "run"),
                 *SMALL]) == 0
    assert len(read_metrics(tmp_path / "run" / "metrics.jsonl")) == 3


def test_prepare_refuses_a_full_out_naming_overwrite_and_meta_json_names_its_tokenizer_absolutely(
        tmp_path, capsys, monkeypatch):
    corpus, out = tmp_path / "corpus.txt", tmp_path / "tokens"
    corpus.write_text("the quick brown fox jumps over the lazy dog\n" * 200)
    (tmp_path / "tok").mkdir()
    from paratrain.data.tokenizer import ByteTokenizer
    ByteTokenizer().save(tmp_path / "tok")
    monkeypatch.chdir(tmp_path)  # the tokenizer given relative to where prepare runs
    assert main(["prepare", "--data", str(corpus), "--tokenizer", "tok/byte_tokenizer.json", "--out", str(out)]) == 0
    spec = json.loads((out / "meta.json").read_text())["tokenizer_spec"]
    assert Path(spec).is_absolute() and Path(spec) == tmp_path / "tok" / "byte_tokenizer.json"
    capsys.readouterr()
    assert main(["prepare", "--data", str(corpus), "--out", str(out)]) == 2
    err = capsys.readouterr().err.strip()
    assert "--overwrite" in err and len(err.splitlines()) == 1
    corpus.write_text("short\n" * 200)
    assert main(["prepare", "--data", str(corpus), "--tokenizer", "tok/byte_tokenizer.json", "--out", str(out),
                 "--overwrite"]) == 0
    assert json.loads((out / "meta.json").read_text())["num_tokens"] == 200 * len("short\n") + 1
    # Read from elsewhere, the corpus still matches its tokenizer given by that absolute path.
    monkeypatch.chdir(tmp_path / "tok")
    from paratrain.data.dataset import build_dataset
    build_dataset(str(out), spec, 16, None, progress=False)


def test_log_every_thins_the_metrics_and_every_record_has_its_grad_norm(tmp_path):
    """The norm comes with the agreement, so every written step has it; --log-every writes every k-th, the last and
    each evaluation's."""
    out = tmp_path / "run"
    assert main(["train", "--steps", "7", "--log-every", "3", "--eval-every", "4", "--out", str(out), *SMALL]) == 0
    records = read_metrics(out / "metrics.jsonl")
    assert [r["step"] for r in records] == [3, 4, 6, 7]
    assert all(math.isfinite(r["grad_norm"]) and r["grad_norm"] > 0 for r in records), records


def _write_environment(out: str) -> None:
    """A launched worker's view of the launcher: the variables named below and its directory, by rank."""
    seen = {k: os.environ.get(k) for k in ("PARATRAIN_PROBE", "PARATRAIN_GONE", "RANK", "WORLD_SIZE")}
    Path(out, f"rank{os.environ['RANK']}.json").write_text(json.dumps({**seen, "cwd": os.getcwd()}))


def test_forked_workers_see_the_launchers_environment_and_directory_at_each_launch(tmp_path, monkeypatch):
    """Workers are forked from a server started by the first launch at the latest (paratrain.forkserver); a
    later launch's workers still get what the launcher has then: a variable set since, one deleted since, its
    directory."""
    from paratrain.launch import launch_processes

    monkeypatch.setenv("PARATRAIN_GONE", "1")
    launch_processes(_write_environment, str(tmp_path), 1)  # the server exists from here on
    monkeypatch.delenv("PARATRAIN_GONE")
    monkeypatch.setenv("PARATRAIN_PROBE", "2")
    (tmp_path / "elsewhere").mkdir()
    monkeypatch.chdir(tmp_path / "elsewhere")
    launch_processes(_write_environment, str(tmp_path), 2)
    seen = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    assert seen == [{"PARATRAIN_PROBE": "2", "PARATRAIN_GONE": None, "RANK": str(r), "WORLD_SIZE": "2",
                     "cwd": str(tmp_path / "elsewhere")} for r in range(2)], seen


def test_a_local_launch_starts_its_worker_server_before_the_launcher_imports_torch(tmp_path):
    """The server imports torch for the workers (seconds of one core) while the launcher imports it on another:
    `paratrain train --nproc 2` decides to launch, and starts the server, before torch is in the launcher."""
    code = ("import sys; from paratrain import forkserver; "
            "forkserver.start = lambda *extra: sys.exit(3 if 'torch' in sys.modules else 4); "
            "from paratrain.cli import main; "
            f"main(['train', '--nproc', '2', '--steps', '1', '--out', {str(tmp_path / 'run')!r}])")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 4, (done.returncode, done.stderr[-2000:])


@pytest.mark.slow
def test_nproc_2_runs_two_processes_through_the_elastic_launcher(tmp_path):
    out = tmp_path / "run"
    result = paratrain("train", "--nproc", "2", "--steps", "3", "--out", str(out), *SMALL, timeout=180)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "2 process(es)" in result.stdout
    records = read_metrics(out / "metrics.jsonl")
    assert [r["step"] for r in records] == [1, 2, 3]
    assert json.loads((out / "config.json").read_text())["run"]["nproc"] == 2


def _children(pid: int) -> list[int]:
    found = []
    for task in Path(f"/proc/{pid}/task").iterdir():
        children = (task / "children").read_text().split()
        found += [int(c) for c in children]
    return found


def _worker_pids(launcher_pid: int) -> list[int]:
    """Training processes: descendants of the launcher running paratrain's worker."""
    pids, frontier = [], [launcher_pid]
    while frontier:
        pid = frontier.pop()
        for child in _children(pid):
            frontier.append(child)
            # Workers are forked by the launcher's forkserver (paratrain.forkserver), which is their parent.
            if b"forkserver" in Path(f"/proc/{pid}/cmdline").read_bytes():
                pids.append(child)
    return pids


@pytest.mark.slow
def test_killing_one_worker_fails_the_run_with_a_clear_message(tmp_path):
    out = tmp_path / "run"
    proc = subprocess.Popen([sys.executable, "-m", "paratrain", "train", "--nproc", "2", "--steps", "100000",
                             "--eval-every", "0", "--out", str(out), *SMALL],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 120
        while not (out / "metrics.jsonl").exists() or len(read_metrics(out / "metrics.jsonl")) < 2:
            assert proc.poll() is None and time.monotonic() < deadline, "training did not start"
            time.sleep(0.2)
        workers = _worker_pids(proc.pid)
        assert len(workers) == 2, workers
        os.kill(workers[-1], signal.SIGKILL)
        _, stderr = proc.communicate(timeout=60)
    finally:
        proc.kill()
    assert proc.returncode == 1
    ours = [line for line in stderr.splitlines() if line.startswith("paratrain train: ")]
    assert ours == ["paratrain train: rank 1 was killed by SIGKILL"], stderr[-3000:]


def test_paratrains_own_warnings_are_one_line_on_the_command_line(tmp_path, capsys):
    argv = ["train", "--n-layers", "1", "--dim", "32", "--n-heads", "4", "--ffn-dim", "64", "--seq-len", "32",
            "--global-batch", "2", "--micro-batch", "2", "--steps", "1", "--sample-tokens", "0", "--eval-every", "0",
            "--no-progress", "--offload", "optimizer", "--out", str(tmp_path / "r")]
    assert main(argv) == 0
    lines = [line for line in capsys.readouterr().err.splitlines() if "offload" in line]
    assert lines == ["paratrain train: warning: offload on the CPU: the masters and optimizer state move to separate "
                     "host buffers, which saves no memory here (on a GPU they leave the device)"]
