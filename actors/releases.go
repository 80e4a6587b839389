package actors

import (
	"context"
	"math"
	"sync"

	"github.com/kvactors/kvactors/messages"
)

// Releases numbers and publishes one engine's releases (PROTOCOL.md v2:
// `released` carries the epoch it answers and rseq 1, 2, … per engine per
// epoch). Request actors publish concurrently, so numbering and publishing
// happen under one lock, and the heartbeat reply, which reports how many
// releases an epoch has had, is built and published under the same lock:
// its count is never ahead of what was already written to the connection, so
// an engine never resyncs for a release that is merely still on its way.
type Releases struct {
	out    *Outbox
	engine string

	mu     sync.Mutex
	counts map[string]epochCount // epoch → releases published
	tick   uint64                // counts a Publish: epochCount.used
}

// epochCount is one epoch's releases published, and when the last was.
type epochCount struct{ n, used uint64 }

// KeptEpochs bounds the epochs whose numbering an engine's Releases keeps:
// past it, the least recently released epoch's count is dropped (its next
// release would be rseq 1 again). A node keeps one Releases per engine id
// for the whole boot, across unregisters and re-registers, so that an
// epoch's rseq goes on across them; each epoch an engine ever used would
// otherwise stay. Requests of old epochs end within a lease of their epoch
// ending (a reset releases them), so only a few epochs are ever in use.
const KeptEpochs = 16

// NewReleases publishes engine's releases on out.
func NewReleases(out *Outbox, engine string) *Releases {
	return &Releases{out: out, engine: engine, counts: map[string]epochCount{}}
}

// Publish numbers and publishes one release of a request of epoch, then
// runs then (if set) before a shutdown's Seal can look. Once the outbox is
// sealed it publishes nothing and reports false.
func (r *Releases) Publish(ctx context.Context, epoch, request, reason string, then func()) bool {
	r.out.sealMu.RLock() // lock order: sealMu, then mu (Reply too)
	defer r.out.sealMu.RUnlock()
	if r.out.sealed {
		return false
	}
	r.mu.Lock()
	defer r.mu.Unlock()
	c, ok := r.counts[epoch]
	if !ok && len(r.counts) >= KeptEpochs {
		r.dropLeastRecent()
	}
	r.tick++
	c.n, c.used = c.n+1, r.tick
	r.counts[epoch] = c
	r.out.releasedLocked(ctx, r.engine, &messages.Released{Request: request, Epoch: epoch, RSeq: c.n,
		Reason: reason})
	if then != nil {
		then()
	}
	return true
}

// Reply publishes the reply build makes from epoch's release count, under
// the lock that orders it after every release it counts.
func (r *Releases) Reply(ctx context.Context, reply, epoch string, build func(released uint64) any) {
	if !r.out.replyOK(reply) { // the reply rule, as Outbox.Reply
		return
	}
	r.out.sealMu.RLock()
	defer r.out.sealMu.RUnlock()
	r.mu.Lock()
	defer r.mu.Unlock()
	r.out.publishLocked(ctx, reply, build(r.counts[epoch].n))
}

// dropLeastRecent forgets the epoch released least recently (KeptEpochs).
// Caller holds r.mu.
func (r *Releases) dropLeastRecent() {
	oldest, at := "", uint64(math.MaxUint64)
	for e, c := range r.counts {
		if c.used < at {
			oldest, at = e, c.used
		}
	}
	delete(r.counts, oldest)
}

// Forget drops an ended epoch's count once none of its requests is left.
func (r *Releases) Forget(epoch string) {
	r.mu.Lock()
	delete(r.counts, epoch)
	r.mu.Unlock()
}
