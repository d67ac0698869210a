"""Generation end to end through the CLI, in this process: the checkpoint's eos token stops
generation unless --ignore-eos. (Seeded sampling at every world size: test_hf_oracle.py.)"""

from __future__ import annotations

import json

from conftest import generated_ids, main_in_process

PROMPT = "11,12,13,14,15,16,17,18,19,20"


def generated(capsys, *argv) -> list[int]:
    capsys.readouterr()
    rc = main_in_process("generate", *argv)
    out = capsys.readouterr()
    assert rc == 0, out.err
    return generated_ids(out.out)


def test_eos_stops_generation_unless_ignored(tiny_ckpt, tmp_path, capsys):
    greedy = generated(capsys, "--ckpt", tiny_ckpt, "--token-ids", PROMPT, "--max-new-tokens", 6)
    eos = greedy[2]
    ckpt = tmp_path / "with_eos"
    ckpt.mkdir()
    for f in tiny_ckpt.iterdir():
        (ckpt / f.name).symlink_to(f)
    (ckpt / "config.json").unlink()
    config = json.loads((tiny_ckpt / "config.json").read_text())
    config["eos_token_id"] = eos
    (ckpt / "config.json").write_text(json.dumps(config))
    stopped = generated(capsys, "--ckpt", ckpt, "--token-ids", PROMPT, "--max-new-tokens", 6)
    assert stopped == greedy[: greedy.index(eos) + 1]
    ignored = generated(capsys, "--ckpt", ckpt, "--token-ids", PROMPT, "--max-new-tokens", 6, "--ignore-eos")
    assert ignored == greedy
