package engine

import (
	"context"
	"log/slog"
	"time"

	"github.com/asynkron/protoactor-go/actor"

	"github.com/kvactors/kvactors/messages"
	"github.com/kvactors/kvactors/sched"
)

// decided carries out a sequencer decision's side effects: an ended epoch
// resets its requests (before anything of the new epoch is routed), a
// resync order is published.
func (a *Actor) decided(c actor.Context, ctx context.Context, d sched.Decision) {
	if e := a.seq.Epoch(); e != a.begun {
		// A new epoch began: the first here, or d.Reset's successor.
		a.begun = e
		if h := a.deps.Request.Hearing; h != nil {
			// Loads are current again (transfer.Hearing), after a silence
			// before any epoch too; not if a silence ended after the message
			// that began the epoch was taken.
			h.ResumedIn(a.epochHearing)
		}
		if t := a.deps.Epochs; t != nil {
			t.began(e)
		}
	}
	if d.Reset != "" {
		a.deps.Log.Info("engine reset: new epoch", "engine", a.deps.Engine, "old", d.Reset, "new", a.seq.Epoch())
		a.deps.Metrics.EpochResets.Inc()
		a.resetAll(c, messages.ReasonEngineReset)
		a.forgetIfIdle(d.Reset)
	}
	if a.resyncOwed {
		d.Resync = nil // a lapse lasts: no order until it ends (lapse), repeats and new gaps included
	}
	if r := d.Resync; r != nil {
		a.deps.Metrics.Resync(r.Reason).Inc()
		if !r.Repeat {
			a.deps.Metrics.EventGaps.Inc()
			a.deps.Log.Warn("resync: applying nothing more of this epoch", "engine", a.deps.Engine,
				"epoch", r.Epoch, "expected", r.Expected, "got", r.Got, "reason", r.Reason)
		}
		if ctx == nil {
			ctx = context.Background()
		}
		a.deps.Outbox.Resync(ctx, a.deps.Engine, &messages.Resync{Node: a.deps.Node, Boot: a.deps.Boot,
			Epoch: r.Epoch, Expected: r.Expected, Got: r.Got, Reason: r.Reason})
	}
}

// expiredAt reports whether the engine has been silent for a lease at now.
// A backlog at intake (Deps.Backlogged: signs of life not seen yet,
// perhaps) defers that by at most one more lease, so a dead engine on a
// busy node still expires.
func (a *Actor) expiredAt(now time.Time) bool {
	if !a.seq.Expired(now) {
		return false
	}
	return a.seq.Silent(now) >= 2*a.deps.Lease || a.deps.Backlogged == nil || !a.deps.Backlogged()
}

// lapse handles a move of the node's fence generation (a lapse began or
// ended) before the message that revealed it: an engine may have declared
// the node lost and reused the blocks of this epoch's requests, so the
// epoch is resynced (reason reconnect: batches were lost with the link) and
// its requests are reset, so none of them copies again (their copies carry
// the old stamp, which the fence refuses anyway). Their engine_reset
// releases carry the old epoch. It reports whether it acted.
func (a *Actor) lapse(c actor.Context) bool {
	g := a.deps.Session()
	if g == a.session {
		return false
	}
	a.session = g
	level := slog.LevelWarn
	if len(a.live) == 0 && a.seq.Resyncing() {
		level = slog.LevelDebug // the lapse's end, or a second look at one: nothing left to do
	}
	a.deps.Log.Log(context.Background(), level, "NATS lapse: the engine may have declared this node lost; resyncing the epoch, resetting its requests",
		"engine", a.deps.Engine, "epoch", a.seq.Epoch(), "requests", len(a.live))
	now := a.deps.Now()
	d := a.seq.Lost(now, messages.ResyncReconnect)
	if g%2 == 1 {
		// The lapse lasts (transfer.Fence: odd generations). Published now,
		// the order would wait in nats.go's reconnect buffer and reach the
		// engine before the round trip that ends the lapse; the epoch it
		// starts would be stamped with this generation and reset once more
		// when the lapse ends. It goes out then.
		d.Resync, a.resyncOwed = nil, true
	} else if a.resyncOwed {
		a.resyncOwed = false
		d.Resync = a.seq.Order(now) // a first order, not the rate-limited repeat: none went out
	}
	a.decided(c, context.Background(), d)
	a.resetAll(c, messages.ReasonEngineReset)
	return true
}

// silenced handles a message of the engine after a silence of lease/2 or
// more (Silenced): like a lapse on the engine's side, the epoch is resynced
// (reason reconnect: what the engine published meanwhile was lost with its
// link) and its requests are reset, so none of them copies again (copies
// were refused meanwhile: transfer.ErrEngineSilent). A message that arrived
// that late may even be one the engine sent before it declared the node
// lost (a stalled link, recovering), so none of the old epoch is applied.
// hearingOf is the hearing generation a message was taken in: its stamp,
// or, unstamped (tests), the generation now.
func (a *Actor) hearingOf(stamped bool, gen uint64) uint64 {
	if stamped {
		return gen
	}
	if h := a.deps.Request.Hearing; h != nil {
		return h.Gen()
	}
	return 0
}

func (a *Actor) silenced(c actor.Context, m *Silenced) {
	a.deps.Log.Warn("engine silent for lease/2 or more: resyncing the epoch, resetting its requests",
		"engine", a.deps.Engine, "silent", m.For, "epoch", a.seq.Epoch(), "requests", len(a.live))
	a.decided(c, context.Background(), a.seq.Lost(a.deps.Now(), messages.ResyncReconnect))
	a.resetAll(c, messages.ReasonEngineReset)
}

// heartbeat answers P.E.heartbeat after every batch the engine sent before
// it (they reach this mailbox first): the last seq applied in the engine's
// epoch and the releases published for it.
func (a *Actor) heartbeat(c actor.Context, m *Heartbeat) {
	ctx := m.Ctx
	if ctx == nil {
		ctx = context.Background()
	}
	if !a.ending() {
		if m.Seq > 0 && a.seq.Begins(m.Epoch) { // it begins the epoch (Sequencer.Heartbeat)
			a.epochHearing = a.hearingOf(m.Stamped, m.HearingGen)
		}
		a.decided(c, ctx, a.seq.Heartbeat(a.deps.Now(), m.Epoch, m.Seq))
	}
	var applied uint64
	if m.Epoch == a.seq.Epoch() {
		applied = a.seq.Applied()
	}
	a.deps.Releases.Reply(ctx, m.Reply, m.Epoch, func(released uint64) any {
		return messages.HeartbeatReply{Node: a.deps.Node, Boot: a.deps.Boot, Epoch: m.Epoch, Applied: applied,
			Released: released}
	})
}
