"""How the search cuts a micro-batch's tokens: sequence tiles (the MLP and the attention half) and the pieces
of a host checkpoint copy. Pure stdlib."""
from __future__ import annotations

from megatrain.planner.shapes.model_shapes import ModelShape
from megatrain.planner.shapes.workload import Workload

# Tokens per sequence tile (MLP and attention half) once sequences are longer (sequence_tile_tokens).
SEQUENCE_TILE_TOKENS = 4096
# Bytes of one host checkpoint copy once a micro-batch's input is larger than two of them (checkpoint_piece_tokens).
CHECKPOINT_PIECE_BYTES = 128 * 2**20


def sequence_tile_tokens(seq_len: int) -> int | None:
    """Sequence tiles for the MLP, and for the attention half's token-local work, once a sequence is longer
    than SEQUENCE_TILE_TOKENS (None: untiled). A tile of 4096 tokens keeps each of its matmuls large enough to
    run at the matmul rate, so tiling costs no time the cost model sees, while the MLP's intermediates and the
    attention half's norm and projection intermediates stop growing with the sequence."""
    return SEQUENCE_TILE_TOKENS if seq_len > SEQUENCE_TILE_TOKENS else None


def checkpoint_piece_tokens(model: ModelShape, work: Workload, micro_batch_size: int) -> int | None:
    """Tokens per host checkpoint copy (``Plan.checkpoint_piece_tokens``). A micro-batch's input is
    t x h x c bytes (t = micro-batch x seq); up to 2 x CHECKPOINT_PIECE_BYTES (256 MiB) it goes in one copy
    (None). Above, pieces of floor(CHECKPOINT_PIECE_BYTES / (h x c)) tokens, 128 MiB each: large enough to run
    at the link's full rate (copies of a few MiB already do), small enough that a block's weights on the h2d
    stream wait for at most one piece on a shared copy engine, and that each reload piece starts as soon as
    its own drain is done. Memory is not changed by the pieces (memory_model: reload buffers hold whole
    micro-batches)."""
    hc = model.hidden_size * work.compute_bytes
    t = min(micro_batch_size, work.batch) * work.seq_len
    if t * hc <= 2 * CHECKPOINT_PIECE_BYTES:
        return None
    return max(1, CHECKPOINT_PIECE_BYTES // hc)
