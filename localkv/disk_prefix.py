"""The disk tier as KVManager.match_prefix reads it: one model's entries loaded straight into
the pool's blocks (through host memory when the pool lives on a GPU), a fresh pool's pages
mapped ahead of the copies."""

import numpy as np

from localkv.backends import vm
from localkv.kv.block_pool import BlockPool
from localkv.kv.disk_store import DiskStore

PREFAULT_RUNS = 4  # a warm load's runs of consecutive blocks up to which their pages are mapped ahead


class DiskPrefix:
    """One model's entries of a DiskStore, for one pool."""

    def __init__(self, disk: DiskStore, fingerprint: str, pool: BlockPool):
        self.disk, self.fp, self.pool = disk, fingerprint, pool

    def contains(self, h: int) -> bool:
        return self.disk.contains(self.fp, h)

    def load_all(self, jobs: list[tuple[int, tuple[int, ...], int]]) -> list[bool]:
        """load() of each (hash, tokens, block id), in order; blocks a fresh pool hands out in
        a few runs of consecutive ids get their pages mapped meanwhile on another thread
        (vm.prefault). Blocks scattered over a pool in use were most likely written before:
        their pages are there, and a call per run and layer would cost more than it saves."""
        spans = self.pool.spans([bid for *_, bid in jobs], PREFAULT_RUNS) if self.pool.xp is np else []
        filler = vm.prefault(spans)
        try:
            return [self.load(h, tokens, bid) for h, tokens, bid in jobs]
        finally:
            if filler is not None:
                filler.join()

    def load(self, h: int, tokens, bid: int) -> bool:
        pool = self.pool
        if pool.xp is np:
            return self.disk.load_into(self.fp, h, tokens, pool.k[:, bid], pool.v[:, bid])
        kv = self.disk.read_like(self.fp, h, tokens, pool.k[:, bid], pool.v[:, bid])
        if kv is None:
            return False
        pool.k[:, bid], pool.v[:, bid] = (pool.xp.asarray(a) for a in kv)
        return True
