"""free_cores: idle cores from /proc/stat samples, and what eval/generate do with it."""

import pytest

from lessmem.base import cpu


def _samples(monkeypatch, *pairs):
    it = iter(pairs)
    monkeypatch.setattr(cpu, "_cpu_times", lambda: next(it))
    monkeypatch.setattr(cpu.time, "sleep", lambda s: None)


@pytest.mark.parametrize("idle, total, machine, want", [
    (200, 200, 2, 2),   # nothing else ran
    (100, 200, 2, 1),   # one core's worth of other work on two
    (0, 200, 2, 1),     # everything busy: still one thread
    (130, 200, 2, 1),   # a core 30% busy is not free
    (300, 400, 4, 3),
])
def test_free_cores_from_idle_share(monkeypatch, idle, total, machine, want):
    _samples(monkeypatch, (1000, 5000), (1000 + idle, 5000 + total))
    monkeypatch.setattr(cpu, "usable_cores", lambda: machine)
    monkeypatch.setattr(cpu.os, "cpu_count", lambda: machine)
    assert cpu.free_cores(0.0) == want


def test_no_proc_stat_means_every_core(monkeypatch):
    monkeypatch.setattr(cpu, "_cpu_times", lambda: None)
    assert cpu.free_cores(0.0) == cpu.usable_cores()


def test_idle_share_bounds():
    assert cpu.idle_share((0, 0), (0, 0)) == 1.0
    assert cpu.idle_share((10, 100), (60, 200)) == 0.5


def test_set_threads_uses_no_more_than_the_free_cores(monkeypatch, capsys):
    import torch

    from lessmem.eval import generate_cli

    before = torch.get_num_threads()
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.setattr(cpu, "free_cores", lambda sample_s=0.1: 1)
    try:
        torch.set_num_threads(2)
        generate_cli.set_threads(None)
        assert torch.get_num_threads() == 1
        assert "using 1 thread" in capsys.readouterr().err
        generate_cli.set_threads(2)  # --threads wins
        assert torch.get_num_threads() == 2
        monkeypatch.setenv("OMP_NUM_THREADS", "2")  # so does the environment
        generate_cli.set_threads(None)
        assert torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(before)
