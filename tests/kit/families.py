"""What the family tests share (tests/server/test_moe_families.py, test_dense_families.py,
test_moe_sessions.py, test_gpt_oss_mxfp4.py): the tiny checkpoints of each family built once per
session, their transformers references, one torch thread, the servers' quantization recipe applied
in one process, and a client over CLI servers of a checkpoint.

tests/server/conftest.py makes the fixtures visible to tests/server. The checkpoints are
session-scoped (a checkpoint is read-only once written, and seeded: every module would build the
same bytes); the references (float32 models in memory) stay module-scoped, so a module's are freed
when it ends.
``one_torch_thread`` is not autouse: a module takes it with
``pytestmark = pytest.mark.usefixtures("one_torch_thread")``.
"""

from __future__ import annotations

import contextlib
from pathlib import Path
from typing import Iterator, Sequence

import pytest
import torch
from transformers import AutoModelForCausalLM

from server.quantization import Quant
from tests.kit.checkpoints import build_tiny_moe
from tests.kit.swarms import SERVER_ARGS
from tests.kit.threads import single_torch_thread


@pytest.fixture(scope="module")
def one_torch_thread():
    with single_torch_thread():
        yield


@pytest.fixture(scope="session")
def family_paths(tmp_path_factory):
    """model_type -> the folder of its tiny random checkpoint (tests/kit/checkpoints.py
    ``build_tiny_moe``: MOE_FAMILIES or DENSE_FAMILIES), built on first use."""
    made: dict[str, Path] = {}

    def get(model_type: str) -> Path:
        if model_type not in made:
            made[model_type] = build_tiny_moe(tmp_path_factory.mktemp("family") / model_type, model_type)
        return made[model_type]

    return get


@pytest.fixture(scope="module")
def references(family_paths):
    """model_type -> transformers' float32 model of its tiny checkpoint, loaded on first use."""
    made = {}

    def get(model_type: str):
        if model_type not in made:
            made[model_type] = AutoModelForCausalLM.from_pretrained(
                family_paths(model_type), dtype=torch.float32
            ).eval()
        return made[model_type]

    return get


def quantized_reference(path: Path, quant: Quant):
    """transformers' float model with its fused experts and linears quantized by the servers' own
    recipe (transformers' bitsandbytes path leaves fused experts in float)."""
    from server.adapters.fused_experts import quantize_loaded_experts
    from server.quantization import quantize_loaded

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    quantize_loaded_experts(model.model.layers, quant, torch.float32)
    quantize_loaded(model.model.layers, quant, torch.float32)
    return model


@contextlib.contextmanager
def cli_swarm_model(
    path: Path, spans: Sequence[tuple[int, int]], log_dir: Path, server_args: Sequence[str] = (), **client_options
) -> Iterator:
    """A client over servers of ``spans`` started with the CLI (``python -m swarm.server``, with
    SERVER_ARGS and ``server_args``) on the checkpoint at ``path``; everything stopped after."""
    from swarm import AutoDistributedModelForCausalLM
    from swarm.local import LocalSwarm

    swarm = LocalSwarm(str(path), spans=list(spans), server_args=[*SERVER_ARGS, *server_args], log_dir=str(log_dir))
    with swarm:
        model = AutoDistributedModelForCausalLM.from_pretrained(
            str(path), initial_peers=swarm.initial_peers, **client_options
        )
        try:
            yield model
        finally:
            model.shutdown()
