"""Lightning's DDP on daskdist through ``DaskdistEnvironment``, against the same run on gloo (same replicas).

Each replica fits a small LightningModule for a few steps, first with
``DDPStrategy(process_group_backend="daskdist", cluster_environment=DaskdistEnvironment())``,
then with Lightning's own environment on gloo met through torchrun's variables;
parameters must be equal on every rank and between the backends.
"""

from __future__ import annotations

import numpy as np
import pytest

import daskdist as dd
from tests.support.torch_libraries import gloo_torchrun_environment, library_settings

torch = pytest.importorskip("torch")
dist = pytest.importorskip("torch.distributed")
pytest.importorskip("lightning")

ROWS, BATCH, STEPS = 64, 8, 4


def _module():
    import lightning.pytorch as pl

    class Regressor(pl.LightningModule):
        def __init__(self):
            super().__init__()
            torch.manual_seed(0)
            self.net = torch.nn.Sequential(torch.nn.Linear(6, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))

        def training_step(self, batch, batch_idx):
            x, y = batch
            return torch.nn.functional.mse_loss(self.net(x), y)

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.1, momentum=0.9)

    return Regressor()


def _loader():
    rng = np.random.default_rng(0)
    x = torch.from_numpy(rng.standard_normal((ROWS, 6)).astype(np.float32))
    y = x.sum(dim=1, keepdim=True) * 0.5
    return torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y), batch_size=BATCH, shuffle=False)


def _fit(strategy, devices: int, num_nodes: int):
    import lightning.pytorch as pl

    module = _module()
    trainer = pl.Trainer(accelerator="cpu", devices=devices, num_nodes=num_nodes, strategy=strategy,
                         max_steps=STEPS, logger=False, enable_checkpointing=False, enable_progress_bar=False,
                         enable_model_summary=False)
    trainer.fit(module, _loader())
    out = [p.detach().numpy().copy() for p in module.parameters()], trainer.world_size, dist.get_backend()
    del trainer, module
    return out


def _both_backends():
    from lightning.pytorch.strategies import DDPStrategy

    from daskdist.plugins.lightning import DaskdistEnvironment

    with library_settings():
        environment = DaskdistEnvironment()
        ranks = (environment.global_rank(), environment.local_rank(), environment.node_rank(),
                 environment.world_size())
        on_daskdist = _fit(DDPStrategy(process_group_backend="daskdist", cluster_environment=environment),
                           environment.local_world_size(), environment.num_nodes())
        dd.plugins.torch.destroy_process_group()
        with gloo_torchrun_environment():
            on_gloo = _fit(DDPStrategy(process_group_backend="gloo"), 2, 1)
    return ranks, on_daskdist, on_gloo


def test_lightning_ddp_on_daskdist_equals_gloo(process_client):
    with dd.MirroredStrategy(client=process_client) as strategy:
        results = strategy.experimental_local_results(strategy.run(_both_backends))
    (ranks0, ours0, gloo0), (ranks1, ours1, gloo1) = results
    assert ranks0 == (0, 0, 0, 2) and ranks1 == (1, 1, 0, 2)  # one host: local rank = rank, node 0
    for ours, gloo in ((ours0, gloo0), (ours1, gloo1)):
        assert ours[1:] == (2, "daskdist") and gloo[1:] == (2, "gloo"), (ours[1:], gloo[1:])
    start = [p.detach().numpy() for p in _module().parameters()]
    assert any(not np.array_equal(a, b) for a, b in zip(ours0[0], start))  # it trained
    for a, b, c, d in zip(ours0[0], ours1[0], gloo0[0], gloo1[0]):
        np.testing.assert_array_equal(a, b)
        np.testing.assert_array_equal(c, d)
        np.testing.assert_allclose(a, c, rtol=1e-6, atol=1e-7)


def _wrong_devices():
    import lightning.pytorch as pl
    from lightning.pytorch.strategies import DDPStrategy

    from daskdist.plugins.lightning import DaskdistEnvironment

    trainer = pl.Trainer(accelerator="cpu", devices=1, num_nodes=1, max_steps=1, logger=False,
                         enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                         strategy=DDPStrategy(process_group_backend="daskdist", cluster_environment=DaskdistEnvironment()))
    trainer.fit(_module(), _loader())


def test_a_trainer_whose_ranks_are_not_the_groups_is_refused(process_client):
    with dd.MirroredStrategy(client=process_client) as strategy:
        with pytest.raises(ValueError, match=r"group has 2 replicas; use Trainer\(devices=2, num_nodes=1\)"):
            strategy.run(_wrong_devices)
    with pytest.raises(RuntimeError, match="inside a function run on the replicas"):
        from daskdist.plugins.lightning import DaskdistEnvironment

        DaskdistEnvironment()
