"""Hugging Face's ``Trainer`` and ``accelerate`` on the daskdist backend, unchanged, against the same run on gloo.

After ``dd.plugins.torch.init_process_group()`` the replicas hold the
environment torchrun would leave (``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``, ...),
so both libraries find the group by themselves. Each replica trains a tiny
randomly-initialised BERT (a config, no download) first on daskdist, then on
gloo met through torchrun's environment (``MASTER_ADDR``/``MASTER_PORT``, the
library initialising gloo itself), in the same worker processes; the
parameters must be equal on every rank and between the backends.
"""

from __future__ import annotations

import os

import numpy as np
import pytest

import daskdist as dd
from tests.support.torch_libraries import gloo_torchrun_environment, library_settings

torch = pytest.importorskip("torch")
dist = pytest.importorskip("torch.distributed")
pytest.importorskip("transformers")
pytest.importorskip("accelerate")

ROWS, SEQ, STEPS, BATCH = 32, 8, 3, 4


def _tiny_bert():
    from transformers import BertConfig, BertForSequenceClassification

    torch.manual_seed(0)
    config = BertConfig(vocab_size=64, hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
                        intermediate_size=32, max_position_embeddings=SEQ, num_labels=2, hidden_dropout_prob=0.0,
                        attention_probs_dropout_prob=0.0)
    return BertForSequenceClassification(config)


def _rows() -> list[dict]:
    rng = np.random.default_rng(0)
    ids = torch.from_numpy(rng.integers(0, 64, (ROWS, SEQ)))
    labels = torch.from_numpy(rng.integers(0, 2, ROWS))
    return [{"input_ids": ids[i], "attention_mask": torch.ones(SEQ, dtype=torch.int64), "labels": labels[i]}
            for i in range(ROWS)]


def _parameters(model) -> list[np.ndarray]:
    return [p.detach().numpy().copy() for p in model.parameters()]


def _hf_trainer(output_dir: str):
    from transformers import Trainer, TrainingArguments

    args = TrainingArguments(output_dir=output_dir, use_cpu=True, per_device_train_batch_size=BATCH, max_steps=STEPS,
                             learning_rate=1e-2, seed=0, report_to="none", save_strategy="no", logging_strategy="no",
                             disable_tqdm=True, dataloader_num_workers=0)
    trainer = Trainer(model=_tiny_bert(), args=args, train_dataset=_rows())
    trainer.train()
    out = _parameters(trainer.model), args.world_size, dist.get_backend() if dist.is_initialized() else None
    del trainer
    return out


def _accelerate_loop():
    from accelerate import Accelerator
    from accelerate.state import AcceleratorState

    AcceleratorState._reset_state(reset_partial_state=True)  # accelerate's state is a per-process singleton
    accelerator = Accelerator(cpu=True)
    model = _tiny_bert()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    loader = torch.utils.data.DataLoader(_rows(), batch_size=BATCH, shuffle=False)
    model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
    for step, batch in enumerate(loader):
        if step == STEPS:
            break
        optimizer.zero_grad()
        accelerator.backward(model(**batch).loss)
        optimizer.step()
    out = _parameters(accelerator.unwrap_model(model)), accelerator.num_processes, dist.get_backend()
    accelerator.free_memory()
    del model, optimizer, accelerator
    AcceleratorState._reset_state(reset_partial_state=True)
    return out


def _both_backends(library: str, output_dir: str):
    train = (lambda: _hf_trainer(output_dir)) if library == "trainer" else _accelerate_loop
    # nothing is downloaded (the model is made from a config)
    with library_settings(HF_HUB_OFFLINE="1", TRANSFORMERS_VERBOSITY="error"):
        dd.plugins.torch.init_process_group()
        on_daskdist = train()
        dd.plugins.torch.destroy_process_group()
        assert "WORLD_SIZE" not in os.environ  # put back as it was
        with gloo_torchrun_environment():
            on_gloo = train()
    return on_daskdist, on_gloo


@pytest.mark.parametrize("library", ["trainer", "accelerate"])
def test_hf_library_trains_on_daskdist_as_on_gloo(process_client, library, tmp_path, monkeypatch):
    """Equal parameters on every rank and on both backends; each library saw 2 processes on daskdist."""
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with dd.MirroredStrategy(client=process_client) as strategy:
        results = strategy.experimental_local_results(strategy.run(_both_backends, args=(library, str(tmp_path))))
    (ours0, gloo0), (ours1, gloo1) = results
    for ours, gloo in ((ours0, gloo0), (ours1, gloo1)):
        assert ours[1:] == (2, "daskdist") and gloo[1:] == (2, "gloo"), (ours[1:], gloo[1:])
    start = _parameters(_tiny_bert())
    assert any(not np.array_equal(a, b) for a, b in zip(ours0[0], start))  # it trained
    for a, b, c, d in zip(ours0[0], ours1[0], gloo0[0], gloo1[0]):
        np.testing.assert_array_equal(a, b)
        np.testing.assert_array_equal(c, d)
        np.testing.assert_allclose(a, c, rtol=1e-6, atol=1e-7)


def test_torchrun_environment_numbers_hosts_as_torchrun_numbers_nodes():
    """LOCAL_RANK is the position on the host, GROUP_RANK the host's; MASTER_ADDR rank 0's host; no port."""
    from daskdist.plugins.torch.environment import torchrun_environment

    hosts = ["b", "a", "b", "b"]
    addresses = ["tcp://10.0.0.2:4001", "tcp://10.0.0.1:4002", "tcp://10.0.0.2:4003", "tcp://10.0.0.2:4004"]
    envs = [torchrun_environment(r, hosts, addresses) for r in range(4)]
    assert [e["LOCAL_RANK"] for e in envs] == ["0", "0", "1", "2"]
    assert [e["LOCAL_WORLD_SIZE"] for e in envs] == ["3", "1", "3", "3"]
    assert [e["GROUP_RANK"] for e in envs] == ["0", "1", "0", "0"]
    assert {e["GROUP_WORLD_SIZE"] for e in envs} == {"2"} and {e["WORLD_SIZE"] for e in envs} == {"4"}
    assert [e["RANK"] for e in envs] == ["0", "1", "2", "3"]
    assert {e["MASTER_ADDR"] for e in envs} == {"10.0.0.2"} and "MASTER_PORT" not in envs[0]
    with pytest.raises(ValueError, match="rank 4 is not one of the 4 members"):
        torchrun_environment(4, hosts, addresses)
