package bench

import "github.com/kvactors/kvactors/wire"

// hashBytes is the size of one block hash: vLLM's default sha256-based
// prefix hash.
const hashBytes = 32

// batch is one encoded P.E.events body (PROTOCOL.md "EventBatch").
type batch struct {
	body   []byte
	events int32
	// applied is how many of the events the node counts in
	// kvactors_events_applied_total: all but "added", which spawns the
	// request actor instead of being applied to one.
	applied int32
	// finishes is how many "finished" events it holds: each is answered by
	// exactly one released (the out-of-process run's progress).
	finishes int32
}

// encoder builds batch bodies with wire.Batch, the engine-side encoder the
// simulated engine uses too, and counts what the node will apply.
type encoder struct {
	b      wire.Batch
	epoch  string
	seq    uint64
	addeds int
	ends   int
	body   []byte
	h      [hashBytes]byte
}

func (e *encoder) begin(epoch string, seq uint64) {
	e.b.Reset()
	e.epoch, e.seq, e.addeds, e.ends = epoch, seq, 0, 0
}

// finish returns an exact-size copy of the body.
func (e *encoder) finish() batch {
	e.body = e.b.Body(e.body, e.epoch, e.seq)
	n := e.b.Events()
	return batch{body: append([]byte(nil), e.body...), events: int32(n), applied: int32(n - e.addeds), finishes: int32(e.ends)}
}

func (e *encoder) added(req string, prompt int) {
	e.b.Added(req, prompt)
	e.addeds++
}

// hashes writes hashes [start, end) of a request; hash(i) fills one.
func (e *encoder) hashes(req string, start, end int, hash func(i int, dst *[hashBytes]byte)) {
	e.b.BeginHashes(req, start)
	for i := start; i < end; i++ {
		hash(i, &e.h)
		e.b.Hash(e.h[:])
	}
	e.b.EndHashes()
}

func (e *encoder) blocks(req string, group, start int, ids []uint32) {
	e.b.Blocks(req, group, start, ids)
}

func (e *encoder) tokens(req string, computed, total int) { e.b.Tokens(req, computed, total) }

func (e *encoder) finished(req string, aborted bool, computed, total int) {
	e.b.Finished(req, aborted, computed, total)
	e.ends++
}

// splitmix64 is a fast, well-mixed 64-bit hash for deterministic content.
func splitmix64(x uint64) uint64 {
	x += 0x9e3779b97f4a7c15
	x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9
	x = (x ^ (x >> 27)) * 0x94d049bb133111eb
	return x ^ (x >> 31)
}

// fillHash writes the 32-byte hash for (seed, i).
func fillHash(seed uint64, i int, dst *[hashBytes]byte) {
	x := splitmix64(seed ^ splitmix64(uint64(i)+1))
	for w := 0; w < hashBytes/8; w++ {
		x = splitmix64(x + uint64(w))
		for b := 0; b < 8; b++ {
			dst[w*8+b] = byte(x >> (8 * b))
		}
	}
}
