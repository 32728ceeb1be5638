"""The bench scripts' own pieces, without running a job: payload sizes, process CPU accounting, FLOPs of attention, and
the refusals of bad arguments before anything runs."""

from __future__ import annotations

import math
import os
import resource
import subprocess
import sys
import time

import pytest
import torch

from bench import broadcast, smolvla_gpu, throughput
from bench.report import ProcessTreeCPU


def test_payload_shapes_sum_to_the_size_asked():
    shapes = broadcast.synthetic_shapes(broadcast.parse_size("70MB"))
    assert sum(math.prod(shape) for shape in shapes.values()) * 4 == 70 * 10**6
    assert max(math.prod(shape) for shape in shapes.values()) <= broadcast.MAX_TENSOR_ELEMENTS
    with pytest.raises(SystemExit, match="10 MB"):
        broadcast.parse_size("10 MB")


def test_process_tree_cpu_counts_what_the_kernel_charges_its_children_and_not_the_roots_past():
    """A child that burns 0.5 CPU-s under a recognisable title: its kind's reading equals what the kernel charges
    this process's reaped children (getrusage), and the root's CPU spent before the block does not count."""
    sum(i * i for i in range(3_000_000))  # CPU of the root before the block
    # It sleeps after burning, so its last reading is taken, then leaves without the interpreter's teardown, whose CPU
    # no reading could see (over 0.03 s on a loaded machine).
    busy = ("import os, time  # burning-child\nend = time.process_time() + 0.5\nwhile time.process_time() < end: pass\n"
            "time.sleep(0.5)\nos._exit(0)")  # fmt: skip
    children = resource.getrusage(resource.RUSAGE_CHILDREN)
    began = time.process_time()

    def kind_of(pid: int, title: str) -> str | None:
        return "root" if pid == os.getpid() else ("burning" if "burning-child" in title else None)

    with ProcessTreeCPU(os.getpid(), kind_of, interval=0.05) as tree:
        subprocess.run([sys.executable, "-c", busy], check=True)
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    charged = (after.ru_utime + after.ru_stime) - (children.ru_utime + children.ru_stime)
    by_kind = tree.by_kind()
    assert by_kind["burning"] >= 0.5 and by_kind["burning"] == pytest.approx(charged, abs=0.03)
    assert 0 <= by_kind["root"] <= time.process_time() - began + 0.02  # only the block's own CPU


@pytest.mark.parametrize("heads, query_length, key_length", [(2, 5, 5), (4, 3, 7)])
def test_flops_of_attention_on_cpu_are_those_of_its_matmuls(heads, query_length, key_length):
    """SDPA on CPU runs kernels torch's FLOP counter has no formula for; the bench's formulas count what the same
    attention costs written as its two matmuls (q k^T, then by v), and backward their four gradient matmuls plus the
    scores q k^T again, which a fused kernel recomputes rather than keeps."""
    query = torch.randn(3, heads, query_length, 8, requires_grad=True)
    key, value = torch.randn(3, heads, key_length, 8, requires_grad=True), torch.randn(3, heads, key_length, 8, requires_grad=True)

    def counted(attention):
        with smolvla_gpu.flop_counter() as forward:
            out = attention()
        with smolvla_gpu.flop_counter() as backward:
            out.sum().backward()
        return forward.get_total_flops(), backward.get_total_flops()

    fused = counted(lambda: torch.nn.functional.scaled_dot_product_attention(query, key, value))
    written_out = counted(lambda: torch.softmax(query @ key.transpose(-1, -2) / 8**0.5, dim=-1) @ value)
    scores = 2 * 3 * heads * query_length * key_length * 8  # q k^T, and as many by v (the same head size)
    assert fused[0] == written_out[0] == 2 * scores and fused[1] == written_out[1] + scores


def test_throughput_refuses_a_bad_rllib_python_before_running_anything(monkeypatch, tmp_path):
    def ran(*args, **kwargs):
        raise AssertionError("the bench ran something before checking --rllib-python")

    monkeypatch.setattr(throughput, "main_job", ran)
    monkeypatch.setattr(throughput, "env_limit", ran)
    monkeypatch.setattr(throughput, "rllib_job", ran)
    with pytest.raises(SystemExit, match="no such file"):
        throughput.main(["--rllib-python", str(tmp_path / "missing" / "python")])
    not_executable = tmp_path / "python"
    not_executable.write_text("#!/bin/sh\n")
    not_executable.chmod(0o644)
    with pytest.raises(SystemExit, match="not executable"):
        throughput.main(["--rllib-python", str(not_executable)])
    # This interpreter runs, but the project's environment has no RLlib.
    with pytest.raises(SystemExit, match="cannot import ray.rllib"):
        throughput.main(["--rllib-python", sys.executable])


def test_smolvla_gpu_bench_refuses_an_unknown_stage_to_skip(capsys):
    with pytest.raises(SystemExit) as exited:
        smolvla_gpu.main(["--size", "tiny", "--skip", "prepare,update"])
    assert exited.value.code == 2 and "--skip: no optional stage named update" in capsys.readouterr().err
