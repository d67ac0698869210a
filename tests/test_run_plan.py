"""The run plan's boundary: the command line is read at the edge (cli.py, commands/) and nowhere
below it; the launcher resolves each setting once and its ranks run on the plan it hands them."""

from __future__ import annotations

import ast
import sys
from pathlib import Path

from conftest import main_in_process, result_fields

import pocketllm
from pocketllm import device_kind
from pocketllm.commands import bench, ranked
from pocketllm.run_plan import ENV_PLAN, DevicePlan, RunPlan, SourcePlan, WorldPlan, received

PACKAGE = Path(pocketllm.__file__).parent
# Flags that exist only on the command line: the plan names them otherwise (world.size, slices.pin,
# profiling.phase ...), so reading one below the commands is reading the namespace.
NAMESPACE_ONLY = {"tp_world", "tp_rank", "comm_overlap_slices", "pin_slices", "phase_profile", "host_profile", "smoke_layers"}


def _below_the_commands():
    for path in sorted(PACKAGE.rglob("*.py")):
        rel = path.relative_to(PACKAGE)
        if rel.parts[0] != "commands" and rel.name not in ("cli.py", "__main__.py"):
            yield rel, ast.parse(path.read_text())


def test_nothing_below_the_commands_takes_or_reads_the_argparse_namespace():
    found = []
    for rel, tree in _below_the_commands():
        for node in ast.walk(tree):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
                a = node.args
                for arg in a.posonlyargs + a.args + a.kwonlyargs:
                    note = ast.unparse(arg.annotation) if arg.annotation is not None else ""
                    # An annotated `args` (a trace event's dict) is not the namespace.
                    if "Namespace" in note or (arg.arg in ("args", "namespace", "ns") and not note):
                        found.append(f"{rel}:{node.lineno} takes {arg.arg}")
            elif isinstance(node, ast.Attribute) and node.attr in NAMESPACE_ONLY:
                found.append(f"{rel}:{node.lineno} reads .{node.attr}")
            elif isinstance(node, ast.Call) and ast.unparse(node.func) == "getattr" and len(node.args) >= 2:
                name = node.args[1]
                if isinstance(name, ast.Constant) and name.value in NAMESPACE_ONLY:
                    found.append(f"{rel}:{node.lineno} reads {name.value!r}")
    assert found == []


def test_the_launcher_resolves_the_device_once_and_its_plan_is_what_a_rank_receives(monkeypatch):
    # Every module that imported resolve_kind counts its calls: a launch of two ranks resolves
    # --device once, in the launcher, and hands that kind to the ranks in the plan.
    real, calls = device_kind.resolve_kind, []

    def counted(requested):
        calls.append(requested)
        return real(requested)

    for mod in [m for name, m in sys.modules.items() if name.startswith("pocketllm") and getattr(m, "resolve_kind", None) is real]:
        monkeypatch.setattr(mod, "resolve_kind", counted)
    started, handed = [], []
    monkeypatch.setattr(ranked, "spawn_local_ranks", lambda run, forward_signals=0.0, checked=None: started.append(run) or handed.append(checked) or 0)
    argv = ["bench", "--preset", "tiny", "--tp-world", "2", "--prompt-tokens", "8", "--max-new-tokens", "3", "--phase-profile", "--pin-slices", "2"]
    assert main_in_process(*argv) == 0
    (plan,) = started
    # The ranks are handed the launcher's checked model plan and prompt with the run plan.
    ((model, ids),) = handed
    assert model.preset == "tiny" and model.cfg.weights is None and len(ids) == 8
    assert calls == ["auto"]
    assert (plan.command, plan.device.kind, plan.world.size, plan.slices.pin, plan.profiling.phase) == ("bench", "cpu", 2, "2", True)
    assert (plan.task.prompt_tokens, plan.task.prompt.max_new_tokens) == (8, 3)
    command, text = received({ENV_PLAN: plan.to_json()})
    assert command == "bench" and RunPlan.from_json(text, bench.Task) == plan


def test_a_launched_rank_runs_on_the_plan_not_on_its_command_line(monkeypatch, capsys):
    # A rank given a plan runs it whatever its argv says: `bench` alone would time a 512-token
    # prompt and 32 new tokens, the plan asks for 8 and 3.
    task = bench.Task(bench.PromptSource(max_new_tokens=3), prompt_tokens=8)
    plan = RunPlan("bench", DevicePlan("cpu", "cpu"), WorldPlan(1), SourcePlan(preset="tiny", dtype="float32"), task=task)
    monkeypatch.setenv(ENV_PLAN, plan.to_json())
    assert main_in_process("bench") == 0
    fields = result_fields(capsys.readouterr().out)
    assert (fields["prefill_tokens"], fields["decode_tokens"]) == ("8", "3")


def test_a_launched_rank_0_shares_the_launchers_check_and_checks_nothing_again(monkeypatch, capsys, tmp_path):
    # The launcher's check() result travels to the ranks (ENV_CHECKED): rank 0 shares it instead
    # of making the model plan and checking the command's inputs a second time.
    from pocketllm import launch

    task = bench.Task(bench.PromptSource(max_new_tokens=3), prompt_tokens=8)
    plan = RunPlan("bench", DevicePlan("cpu", "cpu"), WorldPlan(1), SourcePlan(preset="tiny", dtype="float32"), task=task)
    checked = ranked._checked(plan, bench._prepare)
    monkeypatch.setattr(ranked, "model_plan", lambda *a, **k: (_ for _ in ()).throw(AssertionError("rank 0 checked again")))
    monkeypatch.setattr(bench, "_prepare", lambda *a, **k: (_ for _ in ()).throw(AssertionError("rank 0 checked again")))
    for name, value in {
        launch.ENV_RANK: "0",
        launch.ENV_WORLD: "1",
        launch.ENV_RDZV: str(tmp_path / "store"),
        ENV_PLAN: plan.to_json(),
        launch.ENV_CHECKED: launch._write_checked(str(tmp_path), checked),
    }.items():
        monkeypatch.setenv(name, value)
    assert main_in_process("bench") == 0
    fields = result_fields(capsys.readouterr().out)
    assert (fields["prefill_tokens"], fields["decode_tokens"]) == ("8", "3")
