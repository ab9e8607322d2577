"""Decode CUDA-graph bucketing and padding, tested on CPU with a stand-in capture that replays eagerly."""

from __future__ import annotations

import torch

from omni_backend.engine.cuda_graphs import CapturedGraph, DecodeGraphRunner, capture_batch_sizes


class EagerCapture:
    """Stand-in for TorchCudaGraphCapture: 'replay' re-runs the function into the captured output tensor."""

    def __init__(self):
        self.captured_sizes = []

    def capture(self, fn):
        output = fn()
        self.captured_sizes.append(output.shape[0])
        return CapturedGraph(lambda: output.copy_(fn()), output)


def test_capture_sizes():
    assert capture_batch_sizes(1) == [1]
    assert capture_batch_sizes(8) == [1, 2, 4, 8]
    assert capture_batch_sizes(32) == [1, 2, 4, 8, 16, 24, 32]
    assert capture_batch_sizes(20) == [1, 2, 4, 8, 16, 20]


def test_batches_are_padded_to_the_next_bucket_and_padding_is_inert():
    seen = []

    def decode_fn(ids, positions, slots, context_lens, block_tables, embeds):
        assert embeds is None  # these graphs read token ids
        seen.append((ids.clone(), slots.clone(), context_lens.clone()))
        # a per-row function of every input, so padding or stale rows would show up in the output
        return (ids * 1000 + positions * 10 + context_lens + block_tables[:, 0]).float().unsqueeze(1)

    capture = EagerCapture()
    runner = DecodeGraphRunner(decode_fn, max_num_seqs=16, max_blocks_per_seq=4, device=torch.device("cpu"),
                               capture=capture)
    runner.capture_all()
    assert sorted(capture.captured_sizes) == [1, 2, 4, 8, 16]

    ids = torch.tensor([5, 6, 7], dtype=torch.int64)
    positions = torch.tensor([10, 11, 12], dtype=torch.int64)
    slots = torch.tensor([100, 200, 300], dtype=torch.int64)
    context = torch.tensor([11, 12, 13], dtype=torch.int32)
    tables = torch.tensor([[1, 0, 0, 0], [2, 0, 0, 0], [3, 0, 0, 0]], dtype=torch.int32)
    out = runner.run(ids, positions, slots, context, tables)
    assert out.shape == (3, 1)
    assert out[:, 0].tolist() == [5000 + 100 + 11 + 1, 6000 + 110 + 12 + 2, 7000 + 120 + 13 + 3]
    padded_ids, padded_slots, padded_context = seen[-1]
    assert padded_ids.shape[0] == 4  # bucket for 3 rows
    assert padded_slots[3].item() == -1 and padded_context[3].item() == 0 and padded_ids[3].item() == 0

    # a smaller batch after a larger one must not see the larger batch's stale rows
    runner.run(ids[:1], positions[:1], slots[:1], context[:1], tables[:1])
    assert seen[-1][0].tolist() == [5]
    runner.run(ids[:2], positions[:2], slots[:2], context[:2], tables[:2])
    assert seen[-1][1].tolist() == [100, 200]
    assert runner.num_replays == 3 and runner.num_padded_rows == 1


def test_batches_above_the_largest_bucket_run_eagerly():
    runner = DecodeGraphRunner(lambda *a: a[0].float().unsqueeze(1), max_num_seqs=4, max_blocks_per_seq=2,
                               device=torch.device("cpu"), capture=EagerCapture())
    runner.capture_all()
    five = torch.zeros(5, dtype=torch.int64)
    assert runner.run(five, five, five, five.int(), torch.zeros(5, 2, dtype=torch.int32)) is None
    assert runner.num_replays == 0


def test_graphs_of_a_model_decoding_from_embeddings_read_the_rows_given():
    def decode_fn(ids, positions, slots, context_lens, block_tables, embeds):
        return embeds.sum(dim=1, keepdim=True) + ids.unsqueeze(1)

    runner = DecodeGraphRunner(decode_fn, max_num_seqs=4, max_blocks_per_seq=2, device=torch.device("cpu"),
                               capture=EagerCapture(), embed_width=3)
    runner.capture_all()
    ids = torch.tensor([1, 2, 3])
    embeds = torch.tensor([[1.0, 2.0, 3.0], [0.5, 0.5, 0.5], [0.0, 0.0, -1.0]])
    out = runner.run(ids, ids, ids, ids.int(), torch.zeros(3, 2, dtype=torch.int32), embeds)
    assert out[:, 0].tolist() == [7.0, 3.5, 2.0]
    assert runner.input_embeds.shape == (4, 3)
