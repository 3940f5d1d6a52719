"""Synthetic tasks are deterministic; every rank's data shard is disjoint and complete."""

import pytest
import torch

from kan_models.tasks import TASKS
from strategies.runtime.batch_plan import BatchPlan, rank_micro_batches


def task(name, **kw):
    return TASKS[name](name=name, **kw)


def test_quadratic_is_the_study_task():
    cfg = task("quadratic", n_train=5000, n_test=100)
    data = cfg.generate(seed=3)
    assert data.x_train.min() >= -2 and data.x_train.max() <= 2 and data.x_train.shape == (5000, 2)
    noise = data.y_train - (data.x_train**2).sum(1, keepdim=True)
    assert abs(noise.std().item() - 0.01) < 0.001
    torch.testing.assert_close(data.y_test, (data.x_test**2).sum(1, keepdim=True))  # test targets are clean


@pytest.mark.parametrize("name,kw,dim", [("quadratic", {}, 2), ("exp_sin", {}, 2), ("high_dim", {"dim": 37}, 37)])
def test_generation_is_deterministic_and_seed_dependent(name, kw, dim):
    a = task(name, n_train=64, n_test=16, **kw).generate(seed=1)
    b = task(name, n_train=64, n_test=16, **kw).generate(seed=1)
    c = task(name, n_train=64, n_test=16, **kw).generate(seed=2)
    assert a.x_train.shape == (64, dim) and a.y_train.shape == (64, 1)
    assert torch.equal(a.x_train, b.x_train) and torch.equal(a.y_test, b.y_test)
    assert not torch.equal(a.x_train, c.x_train)


def test_test_set_does_not_depend_on_the_training_set_size():
    small = task("exp_sin", n_train=10, n_test=50).generate(seed=0)
    large = task("exp_sin", n_train=1000, n_test=50).generate(seed=0)
    assert torch.equal(small.x_test, large.x_test)


@pytest.mark.parametrize("n,micro,accum,world", [(1000, 32, 1, 2), (1000, 32, 2, 2), (777, 50, 3, 2), (100, 8, 1, 1)])
def test_every_sample_once_per_epoch_across_ranks(n, micro, accum, world):
    plan = BatchPlan(n_samples=n, global_batch=micro * accum * world, seed=5, epochs=1)
    seen = []
    for step in range(plan.total_steps):
        indices = plan.global_indices(step)
        for rank in range(world):
            parts = rank_micro_batches(indices, accum, world, rank)
            assert len(parts) == accum
            assert all(len(p) <= micro for p in parts)
            seen.extend(torch.cat(parts).tolist())
    assert sorted(seen) == list(range(n))


def test_rank_shards_are_tensor_splits_parts():
    """The shards are cut by arithmetic, and must stay the parts tensor_split made before: a run
    resumed across the change, or compared with an older run, would see other samples."""
    for length in (1, 7, 64, 100, 511):
        indices = torch.randperm(length)
        for accum in (1, 2, 3):
            for world in (1, 2, 3, 4):
                for rank in range(world):
                    expected = [part.tensor_split(world)[rank] for part in indices.tensor_split(accum)]
                    got = rank_micro_batches(indices, accum, world, rank)
                    assert [p.tolist() for p in got] == [p.tolist() for p in expected], (length, accum, world, rank)


def test_the_global_batch_does_not_depend_on_how_it_is_split():
    # single (micro 64) and two ranks x micro 16 x accum 2 train on the same global batches
    one = BatchPlan(n_samples=500, global_batch=64, seed=9, epochs=2)
    two = BatchPlan(n_samples=500, global_batch=16 * 2 * 2, seed=9, epochs=2)
    for step in range(one.total_steps):
        assert torch.equal(one.global_indices(step), two.global_indices(step))


def test_epochs_are_reshuffled_and_counted():
    plan = BatchPlan(n_samples=100, global_batch=30, seed=0, epochs=2)
    assert plan.steps_per_epoch == 4 and plan.total_steps == 8
    assert not torch.equal(plan.epoch_order(0), plan.epoch_order(1))
    assert plan.epochs_done(4) == 1.0 and plan.epochs_done(5) == pytest.approx(1.3)


def test_an_epochs_order_is_drawn_once_and_every_step_slices_it():
    """Drawn per step, the permutation of a large epoch costs more than the fused study step it
    feeds, so it is drawn once per epoch and every step slices it."""
    from strategies.runtime.batch_plan import BatchPlan, epoch_permutation

    plan = BatchPlan(n_samples=1000, global_batch=100, seed=11, steps=30)
    epoch_permutation.cache_clear()
    steps = [plan.global_indices(step) for step in range(30)]
    assert epoch_permutation.cache_info().misses == 3  # one draw per epoch, 10 steps each
    assert sorted(torch.cat(steps[:10]).tolist()) == list(range(1000))
    assert not torch.equal(torch.cat(steps[:10]), torch.cat(steps[10:20]))
