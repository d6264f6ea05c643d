#!/usr/bin/env python3
"""A model of the synchronisation protocol of the fused GDN state + output kernel
(gdn_state_out_fused_kernel in src/cuda/gdn_prefill_slice.cu), run under random schedules: it
checks, without a GPU, that no schedule deadlocks, that no mbarrier wait ever succeeds on the wrong
phase (a waiter two phases behind, or ahead), and that no buffer is read after it was overwritten
or written while its previous contents are still to be read.

What is modelled, per block of the 2-block cluster (both blocks run the same program):
  - mbarriers with PTX semantics: an expected arrival count, pending arrivals, a transaction count
    that may go below zero, and the phase number; a phase completes when the pending arrivals and
    the transaction count are both zero; try_wait.parity(p) succeeds iff the current phase's
    parity differs from p;
  - the chain warpgroup as 4 warps (warp 0 also issues the TMA fills of the 3-stage ring: an
    arrival with expected bytes, the copy landing later as an event that writes the stage), each
    warp's program in the kernel's order: prologue(0)'s wait, per chunk the stage reads, the fill
    of chunk ch + 2, the wait for the staging buffer to be released, h_c and V_new staged and
    announced, the next chunk's wait, the stage released;
  - kOutWgs output warpgroups of 4 warps each (warpgroup k taking the chunks ch % kOutWgs == k):
    qk_p of the first chunk, then per chunk h_c's wait, Q's last read and the stage's release,
    V_new's wait and the staging buffer's release, the row sums sent to the peer block by
    st.async (landing later as an event: 4 bytes per row, completing on the peer's xchg barrier),
    the next chunk's qk_p, the wait for the peer's sums, the re-arm of that slot by warp 0 of the
    warpgroup, and the read of the sums.
Not modelled: the arithmetic, the named barrier of a partial chunk (all chain warps reach it in
the same chunk), the cluster barrier at the start (both blocks' barriers are initialised and the
exchange slots armed before anything else runs: the model's initial state).

    python3 tools/gdn_fused_protocol.py [--schedules 300] [--seed 1]
"""
import argparse
import random
import sys

STAGES, NB = 3, 2


class ProtocolError(Exception):
    pass


class Barrier:
    def __init__(self, name, count):
        self.name, self.count = name, count
        self.pending, self.tx, self.phase = count, 0, 0

    def _maybe_complete(self):
        if self.pending == 0 and self.tx == 0:
            self.phase += 1
            self.pending = self.count

    def arrive(self, expect_tx=0):
        if self.pending <= 0:
            raise ProtocolError(f"{self.name}: more arrivals than its count in phase {self.phase}")
        self.tx += expect_tx
        self.pending -= 1
        self._maybe_complete()

    def complete_tx(self, nbytes):
        self.tx -= nbytes
        # PTX lets the transaction count go below zero within a phase, but this protocol never
        # needs it (every expect_tx comes first): the model holds it to that, so the kernel does
        # not rely on the transient case.
        if self.tx < 0:
            raise ProtocolError(f"{self.name}: {nbytes} bytes completed before they were expected "
                                f"(phase {self.phase})")
        self._maybe_complete()

    def ready(self, k):
        """try_wait.parity(k & 1) for a waiter that means the completion of phase k."""
        return (self.phase & 1) != (k & 1)

    def check_success(self, k, who):
        if self.phase != k + 1:
            raise ProtocolError(f"{who}: wait on {self.name} for phase {k} succeeded with "
                                f"{self.phase} phases completed (aliased parity)")


class Block:
    def __init__(self, rank, out_wgs, norm, mutate=()):
        self.rank = rank
        xs = 2 if "xs_slots_2" in mutate else 2 * out_wgs
        self.full = [Barrier(f"b{rank}.full[{i}]", 1) for i in range(STAGES)]
        self.empty = [Barrier(f"b{rank}.empty[{i}]", 4 if "empty_count_4" in mutate else 8)
                      for i in range(STAGES)]
        self.hc_full = [Barrier(f"b{rank}.hc_full[{i}]", 4) for i in range(NB)]
        self.vn_full = [Barrier(f"b{rank}.vn_full[{i}]", 4) for i in range(NB)]
        self.stg_empty = [Barrier(f"b{rank}.stg_empty[{i}]", 4) for i in range(NB)]
        self.xchg = [Barrier(f"b{rank}.xchg[{i}]", 1) for i in range(xs)]
        if norm:
            for x in self.xchg:  # armed at initialisation, before the cluster barrier
                x.arrive(expect_tx=64 * 4)
        self.stage = [None] * STAGES          # the chunk whose tiles a stage holds
        self.stg = [[None] * 4 for _ in range(NB)]  # per staging buffer, per chain warp's rows
        self.stg_done = [[-10**9] * 4 for _ in range(NB)]  # last chunk each output warp released
        self.xs = [dict() for _ in range(xs)]  # slot -> {sending warp: chunk}


def simulate(n_chunks, out_wgs, norm, rng, mutate=(), max_steps=10**6):
    """One random schedule of one configuration. `mutate`: deliberate protocol errors, to show
    that the model catches them (tests/python/test_gdn_fused_protocol.py): xs_slots_2 (two
    exchange slots whatever the warpgroups), empty_count_4 (the stage released by the chain
    alone), no_stg_wait (the chain stages without waiting for the release), early_empty (the output
    releases the stage before O1 reads Q), no_rearm, rearm_every_warp (each warp of the
    warpgroup re-arms the slot)."""
    blocks = [Block(0, out_wgs, norm, mutate), Block(1, out_wgs, norm, mutate)]
    xs_slots = len(blocks[0].xchg)
    events = []  # (description, callable)

    def chain_warp(B, w):
        who = f"b{B.rank} chain warp {w}"

        def fetch(ch):
            b = ch % STAGES
            if ch >= STAGES:
                yield ("wait", B.empty[b], ch // STAGES - 1)
            B.full[b].arrive(expect_tx=1)

            def land(b=b, ch=ch):
                B.stage[b] = ch
                B.full[b].complete_tx(1)
            events.append((f"b{B.rank} TMA chunk {ch} -> stage {b}", land))

        def read_stage(b, ch):
            if B.stage[b] != ch:
                raise ProtocolError(f"{who}: reads stage {b} for chunk {ch}, it holds {B.stage[b]}")

        if w == 0:
            for ch in range(min(STAGES - 1, n_chunks)):
                yield from fetch(ch)
        yield ("wait", B.full[0], 0)
        read_stage(0, 0)
        for ch in range(n_chunks):
            b, nb = ch % STAGES, ch % NB
            read_stage(b, ch)  # K, W, U of S
            if w == 0 and ch + STAGES - 1 < n_chunks:
                yield from fetch(ch + STAGES - 1)
            if ch >= NB and "no_stg_wait" not in mutate:
                yield ("wait", B.stg_empty[nb], ch // NB - 1)
            if ch >= NB and min(B.stg_done[nb]) < ch - NB:
                raise ProtocolError(f"{who}: stages chunk {ch} in buffer {nb} before every output "
                                    f"warp released chunk {ch - NB}")
            B.stg[nb][w] = ch  # h_c rows
            B.hc_full[nb].arrive()
            yield ("step",)
            B.stg[nb][w] = ch  # V_new columns
            B.vn_full[nb].arrive()
            yield ("step",)
            read_stage(b, ch)  # K of the update
            if ch + 1 < n_chunks:
                yield ("wait", B.full[(ch + 1) % STAGES], (ch + 1) // STAGES)
                read_stage((ch + 1) % STAGES, ch + 1)
            B.empty[b].arrive()
            yield ("step",)

    def out_warp(B, P, k, w):
        who = f"b{B.rank} output warpgroup {k} warp {w}"
        chunks = list(range(k, n_chunks, out_wgs))
        if not chunks:
            return

        def read_stage(b, ch):
            if B.stage[b] != ch:
                raise ProtocolError(f"{who}: reads stage {b} for chunk {ch}, it holds {B.stage[b]}")

        def read_stg(nb, ch):
            if B.stg[nb] != [ch] * 4:
                raise ProtocolError(f"{who}: reads staging buffer {nb} for chunk {ch}, it holds "
                                    f"{B.stg[nb]}")

        first = chunks[0]
        yield ("wait", B.full[first % STAGES], first // STAGES)
        read_stage(first % STAGES, first)  # qk_p: Q, K, gamma
        for ch in chunks:
            b, nb, xb = ch % STAGES, ch % NB, ch % xs_slots
            yield ("wait", B.hc_full[nb], ch // NB)
            if "early_empty" in mutate:
                B.empty[b].arrive()
                yield ("step",)
            read_stg(nb, ch)  # O1 reads h_c
            read_stage(b, ch)  # and Q
            if "early_empty" not in mutate:
                B.empty[b].arrive()
                yield ("step",)
            yield ("wait", B.vn_full[nb], ch // NB)
            read_stg(nb, ch)  # O2 reads V_new
            B.stg_done[nb][w] = ch
            B.stg_empty[nb].arrive()
            yield ("step",)
            if norm:
                def deliver(P=P, xb=xb, ch=ch, sender=(B.rank, k, w)):
                    P.xs[xb][sender] = ch
                    P.xchg[xb].complete_tx(16 * 4)
                events.append((f"b{B.rank} sums of chunk {ch} (warp {w}) -> b{P.rank} slot {xb}",
                               deliver))
            nxt = ch + out_wgs
            if nxt < n_chunks:
                yield ("wait", B.full[nxt % STAGES], nxt // STAGES)
                read_stage(nxt % STAGES, nxt)
            if norm:
                yield ("wait", B.xchg[xb], ch // xs_slots)
                # thread (tid & 127) == 0 re-arms the slot for its next use
                if (w == 0 or "rearm_every_warp" in mutate) and "no_rearm" not in mutate:
                    B.xchg[xb].arrive(expect_tx=64 * 4)
                got = B.xs[xb]
                want = {(P.rank, k, ww): ch for ww in range(4)}
                if got != want:
                    raise ProtocolError(f"{who}: reads the peer's sums of chunk {ch} from slot "
                                        f"{xb}, it holds {got}")
                yield ("step",)

    roles = []
    for B, P in ((blocks[0], blocks[1]), (blocks[1], blocks[0])):
        for w in range(4):
            roles.append([f"b{B.rank} chain {w}", chain_warp(B, w), None])
        for k in range(out_wgs):
            for w in range(4):
                roles.append([f"b{B.rank} out {k}.{w}", out_warp(B, P, k, w), None])

    def advance(role):
        try:
            role[2] = next(role[1])
        except StopIteration:
            role[2] = "done"

    for r in roles:
        advance(r)
    for _ in range(max_steps):
        enabled = []
        for r in roles:
            a = r[2]
            if a == "done":
                continue
            if a[0] == "wait" and not a[1].ready(a[2]):
                continue
            enabled.append(("role", r))
        enabled += [("event", i) for i in range(len(events))]
        if not enabled:
            if all(r[2] == "done" for r in roles):
                return
            stuck = [f"{r[0]} on {r[2][1].name} phase {r[2][2]} ({r[2][1].phase} completed)"
                     for r in roles if r[2] != "done"]
            raise ProtocolError("deadlock: " + "; ".join(stuck))
        kind, x = rng.choice(enabled)
        if kind == "event":
            _, fire = events.pop(x)
            fire()
        else:
            a = x[2]
            if a[0] == "wait":
                a[1].check_success(a[2], x[0])
            advance(x)
    raise ProtocolError("no end after max_steps")


CONFIGS = [(n, wgs, norm) for wgs in (1, 2) for norm in (True, False)
           for n in (1, 2, 3, 4, 5, 7, 9)]


def check(schedules=300, seed=1, configs=None, mutate=()):
    """Every configuration under `schedules` random schedules; returns the number run."""
    rng = random.Random(seed)
    runs = 0
    for n, wgs, norm in configs or CONFIGS:
        for _ in range(schedules):
            simulate(n, wgs, norm, rng, mutate)
            runs += 1
    return runs


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--schedules", type=int, default=300)
    p.add_argument("--seed", type=int, default=1)
    a = p.parse_args(argv)
    try:
        runs = check(a.schedules, a.seed)
    except ProtocolError as e:
        print(f"gdn_fused_protocol: {e}", file=sys.stderr)
        return 1
    print(f"gdn_fused_protocol: {runs} random schedules, no deadlock, aliased wait or stale read")
    return 0


if __name__ == "__main__":
    sys.exit(main())
