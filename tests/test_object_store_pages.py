"""The object-store weight transport lets go of the store's pages in the trainer after each push
(titanrl.memory.release_object_store_pages): they no longer stay in its resident memory, and the
objects stay intact."""

import sys

import numpy as np
import pytest

from titanrl.memory import current_rss_bytes
from titanrl.weight_sync.object_store import ObjectStoreSender

MIB = 1 << 20


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="Ray's store file and madvise: Linux only")
def test_send_after_publish_drops_the_written_pages_and_keeps_the_object(ray_session):
    """A 256 MiB object written from this process maps 256 MiB of the store here; the sender's
    `send` (what follows every publish of at least its threshold; here 0) takes them out of this process's resident memory, and the
    object still reads back equal, here and in another process."""
    ray = ray_session
    data = np.random.default_rng(0).random(32 * MIB // 8 * 8)  # 256 MiB of float64
    written = ray.put(data)
    before = current_rss_bytes()
    assert ObjectStoreSender(release_pages_min_bytes=0).send(0, source=None) == 0.0
    dropped = before - current_rss_bytes()
    assert dropped >= 200 * MIB, f"only {dropped / MIB:.0f} MiB left this process"

    @ray.remote(num_cpus=0)
    def head_sum(x):
        return float(x[:1000].sum())

    assert ray.get(head_sum.remote(written)) == float(data[:1000].sum())
    assert np.array_equal(ray.get(written), data)
