package actors

import (
	"context"
	"slices"
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

	mu       sync.Mutex
	counts   map[string]*epochCount // epoch → releases published
	retained []string               // epochs kept only for a later actor (Retain), oldest first
}

// epochCount is one epoch's releases published; retained: kept only in
// case a later actor of the engine goes on with the epoch (Retain).
type epochCount struct {
	n        uint64
	retained bool
}

// KeptEpochs bounds the epochs an engine's Releases keeps for a later
// actor of the engine (Retain): past it, the one retained longest is
// dropped (a release of it would be rseq 1 again). A node keeps one
// Releases per engine id for the whole boot, across unregisters and
// re-registers, so that an epoch's rseq goes on across them; each ended
// actor's epoch would otherwise stay. Epochs an actor still uses (its own,
// those of its requests) are never dropped.
const KeptEpochs = 16

// NewReleases publishes engine's releases on out.
func NewReleases(out *Outbox, engine string) *Releases {
	return &Releases{out: out, engine: engine, counts: map[string]*epochCount{}}
}

// Publish numbers and publishes one release of a request of epoch, then
// runs then (if set) before a shutdown's Seal can look. Once the outbox is
// sealed it publishes nothing and reports false.
func (r *Releases) Publish(ctx context.Context, epoch, request, reason string, then func()) bool {
	return r.publish(ctx, epoch, request, reason, then, true)
}

// PublishHandedOff is Publish for a release an actor handed on before it
// stopped (a failed request's, published by the copy queue once its copies
// end): it may come after the actor retained the epoch, and is no sign of
// an actor using the epoch again, so a retained epoch stays retained (and
// within KeptEpochs) rather than kept for the boot.
func (r *Releases) PublishHandedOff(ctx context.Context, epoch, request, reason string, then func()) bool {
	return r.publish(ctx, epoch, request, reason, then, false)
}

func (r *Releases) publish(ctx context.Context, epoch, request, reason string, then func(), reuse bool) bool {
	r.out.sealMu.RLock() // lock order: sealMu, then mu (Reply too)
	defer r.out.sealMu.RUnlock()
	if r.out.sealed {
		return false
	}
	r.mu.Lock()
	defer r.mu.Unlock()
	c := r.counts[epoch]
	if c == nil {
		c = &epochCount{}
		r.counts[epoch] = c
	}
	if c.retained && reuse { // an actor uses it again
		c.retained = false
		r.retained = slices.DeleteFunc(r.retained, func(e string) bool { return e == epoch })
	}
	c.n++
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
	var n uint64
	if c := r.counts[epoch]; c != nil {
		n = c.n
	}
	r.out.publishLocked(ctx, PublishReply, reply, build(n))
}

// Epochs is how many epochs' counts are kept (tests: bounded by the
// epochs in use plus KeptEpochs).
func (r *Releases) Epochs() int {
	r.mu.Lock()
	defer r.mu.Unlock()
	return len(r.counts)
}

// Forget drops an ended epoch's count once none of its requests is left.
func (r *Releases) Forget(epoch string) {
	r.mu.Lock()
	defer r.mu.Unlock()
	if c := r.counts[epoch]; c != nil && c.retained {
		r.retained = slices.DeleteFunc(r.retained, func(e string) bool { return e == epoch })
	}
	delete(r.counts, epoch)
}

// Retain: the actor that used epoch (its last one) has stopped, and the
// count is kept only for a later actor of the engine that goes on with the
// epoch; the KeptEpochs most recently retained are kept. A release of it
// makes it used again.
func (r *Releases) Retain(epoch string) {
	r.mu.Lock()
	defer r.mu.Unlock()
	c := r.counts[epoch]
	if c == nil {
		return
	}
	if c.retained { // retained again: the most recent now
		r.retained = slices.DeleteFunc(r.retained, func(e string) bool { return e == epoch })
	}
	c.retained = true
	r.retained = append(r.retained, epoch)
	for len(r.retained) > KeptEpochs {
		delete(r.counts, r.retained[0])
		r.retained = r.retained[1:]
	}
}
