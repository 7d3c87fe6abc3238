"""Post-mortem: from a run store, a verl JSONL directory and a live Prometheus; the JSON contract;
the checkpoint probe, which loads safetensors and refuses a malicious pickle."""

from __future__ import annotations

import json
import os
import pickle
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

import rlwatch
from rlwatch.postmortem import analyse, load, run_postmortem
from rlwatch.postmortem.probe import UnsafeCheckpointError, probe, read_state_dict, save_rollouts

from tests.conftest import free_port, make_step, need_binary, need_module, start_process


def collapsing_run(path: str, steps: int = 60, run: str = "pm") -> None:
    """Quality rises, staleness arrives at step 25 and the mismatch with it, quality collapses at 40."""
    with rlwatch.Watch(run=run, port=None, store=path, staleness_bound=2) as w:
        for step in range(steps):
            stale = step >= 25
            rec = make_step(B=16, T=16, seed=step, noise=0.02 + (0.05 * (step - 25) if stale else 0.0),
                            lag_max=8 if stale else 0)
            quality = min(1.0, step / 20) if step < 40 else 0.05
            rec["rewards"] = torch.full((16,), quality)
            w.observe(step, **rec)
            w.log_scalars(step, {"heldout_true_reward": quality})
            if step % 10 == 0:
                w.record_checkpoint(step, f"/ckpt/checkpoint-{step}")


@pytest.mark.slow
def test_store_postmortem_json_contract(tmp_path, capsys):
    path = str(tmp_path / "pm.db")
    collapsing_run(path)
    doc = run_postmortem(path, out_dir=str(tmp_path / "report"), as_json=True)
    printed = json.loads(capsys.readouterr().out)
    assert printed["collapse_step"] == doc["collapse_step"] == 40
    for key in ("collapse_step", "alerts", "first_signals", "cause", "last_healthy_checkpoint"):
        assert key in printed
    assert {"name", "severity", "step", "labels"} <= set(printed["alerts"][0])
    first = next(f for f in printed["first_signals"] if f["name"] == "mismatch_kl_k3")
    assert {"signal", "step", "lead", "baseline", "value", "size"} <= set(first)
    assert 24 <= first["step"] <= 27 and first["lead"] == 40 - first["step"]
    assert printed["resume"]["checkpoint"]["step"] == 20 and "stale_weights" in printed["resume"]["reason"]
    assert printed["cause"] == "stale_weights"
    critical = [a for a in printed["alerts"] if a["severity"] == "critical"]
    assert critical and min(a["step"] for a in critical) < 40          # paged before the collapse
    assert printed["last_healthy_checkpoint"]["step"] <= 20
    assert Path(doc["report"]["markdown"]).exists()
    assert any(p.endswith("mismatch_kl_k3.png") for p in doc["report"]["plots"])


def test_terminal_report_and_cli(tmp_path):
    path = str(tmp_path / "pm.db")
    collapsing_run(path)
    result = subprocess.run([sys.executable, "-m", "rlwatch", "postmortem", path], capture_output=True,
                            text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert "collapsed at step 40" in result.stdout and "stale_weights" in result.stdout
    missing = subprocess.run([sys.executable, "-m", "rlwatch", "postmortem", str(tmp_path / "nope.db")],
                             capture_output=True, text=True, timeout=60)
    assert missing.returncode == 1 and "not found" in missing.stderr and "nope.db" in missing.stderr
    assert "Traceback" not in missing.stderr


def test_healthy_run_has_no_collapse(tmp_path):
    path = str(tmp_path / "ok.db")
    with rlwatch.Watch(run="ok", port=None, store=path) as w:
        for step in range(40):
            rec = make_step(B=8, T=8, seed=step, lag_max=0, noise=0.01)
            rec["rewards"] = torch.full((8,), min(1.0, step / 20))
            w.observe(step, **rec)
    report = analyse(load(path))
    assert report.collapse_step is None
    doc = report.as_json()
    assert doc["first_alert_lead"] is None
    assert doc["last_healthy_checkpoint"] is None and doc["resume"]["checkpoint"] is None
    assert "no collapse" in doc["resume"]["reason"]


def test_verl_file_logger_directory(tmp_path):
    (tmp_path / "global_step_10").mkdir()
    (tmp_path / "global_step_20").mkdir()
    lines = []
    for step in range(1, 41):
        quality = min(1.0, step / 15) if step < 30 else 0.1
        k3 = 0.001 if step < 20 else 0.001 * (step - 18) ** 2
        lines.append(json.dumps({"step": step, "data": {"critic/score/mean": quality, "rollout_corr/k3_kl": k3,
                                                         "rollout_corr/kl": -0.5 * k3, "actor/entropy": 1.0}}))
    (tmp_path / "metrics.jsonl").write_text("\n".join(lines))
    report = analyse(load(str(tmp_path)))
    assert report.collapse_step == 30
    kl = next(c for c in report.first_signals if c.signal == "mismatch_kl_k3")
    assert 19 <= kl.step <= 22 and kl.lead == 30 - kl.step
    assert report.last_healthy_checkpoint[0] == 10          # global_step_20 is after k3 started moving


def test_live_prometheus_source(tmp_path):
    prometheus_bin = need_binary("prometheus")
    exporter_port, prom_port = free_port(), free_port()
    from rlwatch.alerts import render

    (tmp_path / "prometheus.yml").write_text(render.to_yaml({
        "global": {"scrape_interval": "1s"},
        "scrape_configs": [{"job_name": "rlwatch", "honor_labels": True,
                            "static_configs": [{"targets": [f"127.0.0.1:{exporter_port}"]}]}]}))
    prom = start_process([prometheus_bin, f"--config.file={tmp_path / 'prometheus.yml'}",
                          f"--storage.tsdb.path={tmp_path / 'data'}", f"--web.listen-address=127.0.0.1:{prom_port}"],
                         prom_port, tmp_path / "prom.log")
    try:
        with rlwatch.Watch(run="live", port=exporter_port, store=str(tmp_path / "live.db")) as w:
            import urllib.request
            deadline = time.time() + 30
            while time.time() < deadline:               # wait for the first scrape before stepping
                body = urllib.request.urlopen(prom.url + "/api/v1/query?query=up", timeout=5).read()
                if b'"1"' in body:
                    break
                time.sleep(0.3)
            for step in range(16):
                rec = make_step(B=8, T=8, seed=step)
                rec["rewards"] = torch.full((8,), 1.0 if step < 10 else 0.0)
                w.observe(step, **rec)
                time.sleep(1.1)
        from rlwatch.postmortem.prometheus import from_prometheus

        data = from_prometheus(prom.url, "live")
        # The same run from its store, against its Prometheus range as the baseline: aligned by
        # step, the two sources agree (any combination of sources works).
        doc = run_postmortem(str(tmp_path / "live.db"), baseline=prom.url, baseline_run="live", quiet=True)
    finally:
        prom.stop()
    steps = [s for s, _ in data.steps]
    assert len(steps) >= 12 and steps == sorted(steps)
    assert data.series("mismatch_kl_k3") and data.series("reward_mean")
    report = analyse(data)
    assert report.collapse_step is not None and 10 <= report.collapse_step <= 12
    comparison = doc["comparison"]
    assert comparison["common_steps"][2] >= 12 and len(comparison["compared"]) >= 5
    assert comparison["divergences"] == [], comparison["divergences"]


def tiny_hf_checkpoint(directory: Path, seed: int, scale: float = 0.0) -> None:
    transformers = need_module("transformers")
    torch.manual_seed(0)
    config = transformers.Qwen2Config(vocab_size=32, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                                      num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=64)
    model = transformers.Qwen2ForCausalLM(config)
    with torch.no_grad():
        g = torch.Generator().manual_seed(seed)
        for p in model.parameters():
            p.add_(scale * torch.randn(p.shape, generator=g))
    model.save_pretrained(str(directory), safe_serialization=True)


def test_probe_measures_how_far_each_checkpoint_moved(tmp_path):
    for step, scale in ((1, 0.0), (2, 0.05), (3, 0.5)):
        tiny_hf_checkpoint(tmp_path / f"checkpoint-{step}", seed=step, scale=scale)
    ids = torch.randint(0, 32, (4, 12), generator=torch.Generator().manual_seed(0))
    response = torch.zeros(4, 12, dtype=torch.long)
    response[:, 6:] = 1
    save_rollouts(tmp_path / "rollouts.safetensors", ids, torch.ones(4, 12, dtype=torch.long), response)
    results = probe([(s, str(tmp_path / f"checkpoint-{s}")) for s in (1, 2, 3)], tmp_path / "rollouts.safetensors")
    assert [r.error for r in results] == [None, None, None]
    assert all(r.mean_logp is not None and r.mean_logp < 0 for r in results)
    assert 0 < results[0].kl_to_next < results[1].kl_to_next          # the bigger update moved it further
    assert results[2].kl_to_next is None


class _Payload:
    def __reduce__(self):
        return (os.system, (f"touch {os.environ.get('RLWATCH_PWNED', '/tmp/rlwatch-pwned')}",))


@pytest.mark.frameworks          # the probe loads the checkpoint with transformers
def test_malicious_pickle_in_a_checkpoint_is_refused(tmp_path, monkeypatch):
    marker = tmp_path / "pwned"
    monkeypatch.setenv("RLWATCH_PWNED", str(marker))
    bad = tmp_path / "checkpoint-9"
    bad.mkdir()
    (bad / "config.json").write_text(json.dumps({"model_type": "qwen2"}))
    with open(bad / "pytorch_model.bin", "wb") as f:
        pickle.dump({"weight": _Payload()}, f)
    with pytest.raises(UnsafeCheckpointError, match="refused to unpickle"):
        read_state_dict(bad)
    assert not marker.exists()
    ids = torch.zeros(1, 4, dtype=torch.long)
    save_rollouts(tmp_path / "r.safetensors", ids, torch.ones_like(ids), torch.ones_like(ids))
    results = probe([(9, str(bad))], tmp_path / "r.safetensors")
    assert "UnsafeCheckpointError" in results[0].error and not marker.exists()


def test_probe_scores_each_checkpoint_once_however_its_path_is_spelled(tmp_path, monkeypatch):
    """A store records checkpoints absolute, a TRL directory read from a relative path lists them
    relative: one row per checkpoint, and no "KL to next 0" between a checkpoint and itself."""
    for step, scale in ((1, 0.0), (2, 0.05)):
        tiny_hf_checkpoint(tmp_path / f"checkpoint-{step}", seed=step, scale=scale)
    ids = torch.randint(0, 32, (2, 8), generator=torch.Generator().manual_seed(0))
    response = torch.zeros(2, 8, dtype=torch.long)
    response[:, 4:] = 1
    save_rollouts(tmp_path / "rollouts.safetensors", ids, torch.ones(2, 8, dtype=torch.long), response)
    monkeypatch.chdir(tmp_path)
    both = [(s, str(tmp_path / f"checkpoint-{s}")) for s in (1, 2)] + [(s, f"checkpoint-{s}") for s in (1, 2)]
    results = probe(both, "rollouts.safetensors")
    assert [(r.step, r.path) for r in results] == [(s, str(tmp_path / f"checkpoint-{s}")) for s in (1, 2)]
    assert results[0].kl_to_next > 0 and results[1].kl_to_next is None
