"""Weight transports (titanrl.weight_sync): a trainer's weights reach a real vLLM engine bit for bit.

The sender is a real GRPOTrainer (a Ray actor holding a checkpoint with other weights than the
engine's); the receiver is the session's in-process vLLM engine. Every test that loads weights
into the engine restores the checkpoint's weights before it returns.
"""

import threading
from pathlib import Path

import pytest
import torch

pytest.importorskip("vllm")

from titanrl.config import EngineConfig
from titanrl.models.hf_checkpoint import read_state_dict  # noqa: E402
from titanrl.models.tiny import write_tiny_checkpoint  # noqa: E402
from titanrl.rollout.weight_receiver import WeightReceiver  # noqa: E402
from titanrl.trainer.setup import TrainerSetup
from titanrl.weight_sync import (  # noqa: E402
    TensorsWeights,
    WeightSyncError,
    layout_of,
    make_plan,
    make_sender,
)
from titanrl.weight_sync.segment import segment_names  # noqa: E402
from titanrl.weight_sync.shared_memory import PIPELINED  # noqa: E402

SHM = Path("/dev/shm")


@pytest.fixture(scope="module")
def other_checkpoint(tmp_path_factory):
    """Same architecture as the engine's checkpoint (tiny_config), other weights (another seed)."""
    return write_tiny_checkpoint(tmp_path_factory.mktemp("ws_other") / "ckpt", seed=7, std=0.1)


@pytest.fixture(scope="module")
def trainer(ray_session, other_checkpoint):
    """A GRPOTrainer actor on `other_checkpoint`, the sender of every push here."""
    from titanrl.config import ModelConfig, TrainConfig
    from titanrl.trainer.trainer import GRPOTrainer

    actor = (
        ray_session.remote(GRPOTrainer)
        .options(num_cpus=0)
        .remote(TrainerSetup(ModelConfig(checkpoint=str(other_checkpoint)), TrainConfig(), 1.0, 0))
    )
    ray_session.get(actor.get_version.remote())
    yield actor
    ray_session.get(actor.close_weight_sync.remote())
    ray_session.kill(actor)


def _assert_engine_holds(engine, state: dict[str, torch.Tensor]) -> None:
    running = engine.worker_state_dict()
    assert set(running) == set(state)
    for name, tensor in state.items():
        assert torch.equal(running[name], tensor), name


def _restore(engine, checkpoint) -> None:
    engine.update_weights(read_state_dict(checkpoint), version=engine.policy_version + 1)
    _assert_engine_holds(engine, read_state_dict(checkpoint))


def _open(ray, trainer, receiver, plan) -> None:
    """Both ends at once: a broadcast group forms only when every member joins."""
    opened = trainer.open_weight_sync.remote(plan)
    receiver.open(plan, 1)
    ray.get(opened)


def _push(ray, trainer, receiver, version: int):
    ann_ref = trainer.publish_weights.remote(version)
    sent = trainer.send_weights.remote(version)
    announcement = ray.get(ann_ref)
    seconds = receiver.receive(announcement, version)
    ray.get(sent)
    assert seconds > 0
    return announcement


@pytest.mark.parametrize("transport", ["object_store", "shared_memory", "broadcast"])
def test_transport_delivers_trainer_weights_bit_exact(transport, ray_session, trainer, vllm_engine,
                                                      vllm_tiny_checkpoint, other_checkpoint):
    """Each transport loads the trainer's weights into the vLLM engine bit for bit, twice in a row
    (the second push reuses what the first set up: segment, group, bucket buffers), with the
    engine reset to its own weights in between so the second push has to move every byte again.
    Broadcast runs with buckets smaller than the largest tensor: tensors of at least half the
    largest go in broadcasts of their own (straight into the parameters), smaller ones are packed
    and some span buckets.
    Shared memory: the segment's name is gone as soon as the worker has mapped it, and nothing
    of the trainer's is left in /dev/shm after close."""
    ray = ray_session
    target = read_state_dict(other_checkpoint)
    largest = max(t.numel() * t.element_size() for t in target.values())
    total = sum(t.numel() * t.element_size() for t in target.values())
    bucket = (largest // 3) // 64 * 64
    assert bucket < largest < total
    plan = make_plan(transport, 1, bucket_bytes=bucket, direct_bytes=largest // 2, timeout_s=60)
    receiver = WeightReceiver(vllm_engine)
    start = vllm_engine.policy_version
    try:
        _open(ray, trainer, receiver, plan)
        first = _push(ray, trainer, receiver, start + 1)
        assert vllm_engine.policy_version == start + 1
        _assert_engine_holds(vllm_engine, target)
        if transport == "shared_memory":
            assert not (SHM / first.segment).exists()  # unlinked once mapped: a crash leaves no name
            assert vllm_engine.last_push_views == len(target)  # zero copy: every tensor viewed, none copied
        _restore(vllm_engine, vllm_tiny_checkpoint)
        second = _push(ray, trainer, receiver, start + 3)
        assert vllm_engine.policy_version == start + 3
        _assert_engine_holds(vllm_engine, target)
        if transport == "shared_memory":
            assert second.segment == first.segment  # reused, already mapped on both sides
        if transport == "broadcast":
            assert second.bucket_bytes == bucket
    finally:
        receiver.close()
        ray.get(trainer.close_weight_sync.remote())
        _restore(vllm_engine, vllm_tiny_checkpoint)
    if transport == "shared_memory":
        creator = first.segment.split("_")[2]
        assert segment_names(pid=int(creator)) == []


def _wrong_model_weights() -> TensorsWeights:
    """Weights of a model with another hidden size than the engine's."""
    from titanrl.models.qwen3 import Qwen3ForCausalLM
    from titanrl.models.tiny import tiny_config

    model = Qwen3ForCausalLM(tiny_config(hidden_size=64))
    model.init_weights(seed=0, std=0.1)
    from titanrl.models.hf_checkpoint import hf_state_dict

    return TensorsWeights(hf_state_dict(model))


@pytest.mark.parametrize("transport", ["object_store", "shared_memory"])
def test_wrong_model_or_version_is_refused_before_any_write(transport, vllm_engine, vllm_tiny_checkpoint):
    """An announcement of another model's weights fails with an error naming the tensor that does
    not fit, one for another version than the caller says fails too, and (shared memory) one the
    trainer never writes fails after the timeout; the engine keeps its version and weights."""
    plan = make_plan(transport, 1, timeout_s=0.5)
    sender = make_sender(plan)
    receiver = WeightReceiver(vllm_engine)
    start = vllm_engine.policy_version
    try:
        receiver.open(plan, 1)
        bad = sender.publish(start + 1, _wrong_model_weights())
        with pytest.raises(WeightSyncError, match=r"do not fit this engine's model.*model\.embed_tokens\.weight"):
            receiver.receive(bad, start + 1)
        good = sender.publish(start + 2, TensorsWeights(read_state_dict(vllm_tiny_checkpoint)))
        with pytest.raises(WeightSyncError, match="announcement is for version"):
            receiver.receive(good, start + 3)
        if transport == "shared_memory" and PIPELINED:
            # Announced but never written (no send_weights): the worker gives up after the timeout.
            with pytest.raises(WeightSyncError, match=r"not written within its timeout.*send_weights"):
                receiver.receive(good, start + 2)
    finally:
        receiver.close()
        sender.close()
    assert vllm_engine.policy_version == start
    _assert_engine_holds(vllm_engine, read_state_dict(vllm_tiny_checkpoint))


def test_broadcast_refusal_fails_both_ends_without_hanging(vllm_engine, vllm_tiny_checkpoint):
    """Broadcast of another model's weights: the worker refuses with the same clear error, and the
    trainer (here a thread of this process) learns it through the group and fails too instead of
    waiting for a receiver that never comes; the engine's weights are untouched."""
    plan = make_plan("broadcast", 1, timeout_s=60)
    announced = threading.Event()
    box: dict = {}

    def trainer_side() -> None:
        sender = make_sender(plan)
        try:
            weights = _wrong_model_weights()
            box["announcement"] = sender.publish(7, weights)
            announced.set()
            sender.send(7, weights)
        except WeightSyncError as e:
            box["error"] = e
        finally:
            announced.set()
            sender.close()

    thread = threading.Thread(target=trainer_side)
    thread.start()
    receiver = WeightReceiver(vllm_engine)
    start = vllm_engine.policy_version
    try:
        receiver.open(plan, 1)
        assert announced.wait(60)
        with pytest.raises(WeightSyncError, match="do not fit this engine's model"):
            receiver.receive(box["announcement"], 7)
    finally:
        thread.join(60)
        receiver.close()
    assert not thread.is_alive()
    assert "refused" in str(box.get("error"))
    assert vllm_engine.policy_version == start
    _assert_engine_holds(vllm_engine, read_state_dict(vllm_tiny_checkpoint))


def test_bad_plan_and_layout_inputs_name_the_field():
    """Plans and layouts reject bad input with errors that name what to change."""
    with pytest.raises(ValueError, match="rollout.weight_transport"):
        make_plan("pigeon", 1)
    with pytest.raises(ValueError, match="num_receivers"):
        make_plan("shared_memory", 0)
    with pytest.raises(ValueError, match="bucket_bytes"):
        make_plan("broadcast", 1, bucket_bytes=100)
    with pytest.raises(WeightSyncError, match="names a tensor twice"):
        layout_of([("a", torch.zeros(2)), ("a", torch.zeros(3))])


def test_layout_buckets_cover_every_byte_once():
    """Bucket pieces tile every tensor exactly once, element-aligned, including tensors spanning
    several buckets and mixed dtypes."""
    from titanrl.weight_sync.layout import bucket_pieces

    tensors = [("a", torch.zeros(3, 100)), ("b", torch.zeros(5, dtype=torch.bfloat16)), ("c", torch.zeros(1000))]
    layout = layout_of(tensors)
    covered = [torch.zeros(t.numel(), dtype=torch.int32) for _, t in tensors]
    for k, bucket in enumerate(bucket_pieces(layout, 256)):
        for p in bucket:
            spec = layout.tensors[p.index]
            assert 0 <= p.start and p.start + p.count * spec.itemsize <= 256
            assert k * 256 + p.start == spec.offset + p.first * spec.itemsize
            covered[p.index][p.first : p.first + p.count] += 1
    assert all(bool((c == 1).all()) for c in covered)


def test_broadcast_ops_send_every_byte_once_in_one_order():
    """Every member derives the same broadcasts from the layout: each large tensor once, in place;
    the small ones packed exactly once; bucket k issued once its last piece is packed, in order."""
    from titanrl.weight_sync.broadcast import push_ops

    tensors = [("a", torch.zeros(3, 100)), ("b", torch.zeros(5, dtype=torch.bfloat16)), ("c", torch.zeros(1000)),
               ("d", torch.zeros(90)), ("e", torch.zeros(7, 10))]
    layout = layout_of(tensors)
    plan = push_ops(layout, 256, direct_bytes=1000)
    direct = [n for kind, n in plan.ops if kind == "direct"]
    buckets = [n for kind, n in plan.ops if kind == "bucket"]
    assert direct == [0, 2] and buckets == list(range(len(plan.buckets)))
    assert [layout.tensors[i].name for i in plan.small] == ["b", "d", "e"]
    covered = [torch.zeros(layout.tensors[i].numel, dtype=torch.int32) for i in plan.small]
    for k, bucket in enumerate(plan.buckets):
        assert plan.lengths[k] <= 256
        for p in bucket:
            assert p.start + p.count * plan.packed.tensors[p.index].itemsize <= plan.lengths[k]
            covered[p.index][p.first : p.first + p.count] += 1
        position = plan.ops.index(("bucket", k))  # after the op of the tensor that completes it
        completing = plan.small[bucket[-1].index]
        assert all(i <= completing for kind, i in plan.ops[:position] if kind == "direct")
        assert all(i > completing for kind, i in plan.ops[position:] if kind == "direct")
    assert all(bool((c == 1).all()) for c in covered)
    assert len(plan.buckets) > 1  # "d" spans buckets


@pytest.mark.slow
def test_multiprocess_engine_receives_tensors_from_every_transport(tmp_path, ray_session, trainer, other_checkpoint):
    """The multiprocess engine (engine core in its own process) loads the trainer's weights bit
    for bit through every transport: its process maps the segment or joins the broadcast group
    itself, and the object store's tensors reach it through a local segment, not a file."""
    from titanrl.rollout.vllm.engine import VllmEngine, VllmEngineConfig

    ckpt = write_tiny_checkpoint(tmp_path / "ckpt", seed=3, std=0.1)
    target = read_state_dict(other_checkpoint)
    config = VllmEngineConfig(
        checkpoint=str(ckpt), settings=EngineConfig(max_model_len=128, max_num_seqs=8, multiprocess=True)
    )
    with VllmEngine(config) as engine:
        for version, transport in enumerate(["object_store", "shared_memory", "broadcast"], start=1):
            plan = make_plan(transport, 1, bucket_bytes=64 << 10, timeout_s=60)
            receiver = WeightReceiver(engine)
            _open(ray_session, trainer, receiver, plan)
            _push(ray_session, trainer, receiver, version)
            assert engine.policy_version == version
            _assert_engine_holds(engine, target)
            # Both segment routes load zero-copy: the trainer's and the engine's own (object store).
            assert engine.last_push_views == (len(target) if transport != "broadcast" else 0)
            receiver.close()
            ray_session.get(trainer.close_weight_sync.remote())
            engine.update_weights(read_state_dict(ckpt), version=version)  # back, via the local segment
            _assert_engine_holds(engine, read_state_dict(ckpt))
        local = engine._local_sender.segments[0].name
    assert not (SHM / local).exists()


@pytest.mark.slow
def test_parallel_trainer_group_publishes_gathered_weights(ray_session, vllm_engine, vllm_tiny_checkpoint,
                                                           other_checkpoint):
    """A TrainerGroup with tp=2 (every matrix sharded over two rank actors) pushes through every
    transport: rank 0 sends while the other rank joins the gathers in the same call, and the
    engine ends up with exactly the checkpoint's full tensors."""
    from titanrl.config import ModelConfig, ParallelConfig, TrainConfig
    from titanrl.trainer.trainer_group import TrainerGroup

    group = (
        ray_session.remote(TrainerGroup)
        .options(num_cpus=0)
        .remote(
            TrainerSetup(
                ModelConfig(checkpoint=str(other_checkpoint)), TrainConfig(parallel=ParallelConfig(tp=2)), 1.0, 0
            )
        )
    )
    target = read_state_dict(other_checkpoint)
    receiver = WeightReceiver(vllm_engine)
    try:
        for transport in ["object_store", "shared_memory", "broadcast"]:
            plan = make_plan(transport, 1, bucket_bytes=64 << 10, timeout_s=60)
            _open(ray_session, group, receiver, plan)
            _push(ray_session, group, receiver, vllm_engine.policy_version + 1)
            _assert_engine_holds(vllm_engine, target)
            receiver.close()
            ray_session.get(group.close_weight_sync.remote())
            _restore(vllm_engine, vllm_tiny_checkpoint)
    finally:
        receiver.close()
        ray_session.kill(group)
        _restore(vllm_engine, vllm_tiny_checkpoint)


def test_parameter_shapes_follow_each_models_config():
    """The publisher's layout comes from cached shapes (a meta model costs ~10 ms per push):
    alternating two configs, each gets its own model's names and shapes, and callers cannot
    alter the cached list."""
    from types import SimpleNamespace

    from titanrl.models.architectures import build_model
    from titanrl.models.tiny import tiny_config
    from titanrl.trainer.parallel.gather import hf_parameter_shapes

    configs = [tiny_config(), tiny_config(hidden_size=64, num_hidden_layers=3, tie_word_embeddings=False)]
    expected = [[(n, p.shape) for n, p in build_model(c).named_parameters()] for c in configs]
    assert expected[0] != expected[1]
    for _ in range(2):
        for config, shapes in zip(configs, expected):
            got = hf_parameter_shapes(SimpleNamespace(config=config))
            assert got == shapes
            got.clear()
