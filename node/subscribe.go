package node

import (
	"context"
	"fmt"
	"time"

	"github.com/nats-io/nats.go"

	"github.com/kvactors/kvactors/actors"
	"github.com/kvactors/kvactors/actors/engine"
	"github.com/kvactors/kvactors/hostpool"
	"github.com/kvactors/kvactors/ingest"
	"github.com/kvactors/kvactors/messages"
)

// subscribe wires the protocol subjects into the ingester: events, and
// register, status, lookup and load as request/reply.
func (n *Node) subscribe() error {
	n.ingest = newIngester(n, n.cfg.DecodeWorkers)
	for _, verb := range []string{actors.VerbEvents, actors.VerbRegister, actors.VerbStatus,
		actors.VerbLookup, actors.VerbLoad} {
		subject := n.cfg.Prefix + ".*." + verb
		s, err := n.nc.ChanSubscribe(subject, n.ingest.in)
		if err != nil {
			return fmt.Errorf("subscribe %s: %w", subject, err)
		}
		n.subs = append(n.subs, s)
	}
	if err := n.nc.Flush(); err != nil {
		return fmt.Errorf("flush subscriptions: %w", err)
	}
	return nil
}

func (n *Node) onRegister(engineID string, m *nats.Msg) {
	ctx := n.msgCtx(m)
	spec, err := ingest.DecodeSpec(m.Data, n.cfg.Limits)
	if err == nil {
		err = n.register(engineID, spec)
	}
	if err != nil {
		n.rejected(actors.ReasonBadSpec, "register refused", "engine", engineID, "err", err)
		n.outbox.Reply(ctx, m.Reply, messages.RegisterReply{Error: err.Error()})
		return
	}
	n.outbox.Reply(ctx, m.Reply, messages.RegisterReply{OK: true})
}

// StatusReply is the body of a P.E.status reply.
type StatusReply struct {
	engine.Status
	Pool      hostpool.Stats `json:"pool"`
	SlotBytes int64          `json:"slot_bytes"`
	StatusPage
	Error string `json:"error,omitempty"`
}

// Status gathers one engine's snapshot (also served on /debug/engines).
func (n *Node) Status(engineID string, timeout time.Duration) (StatusReply, error) {
	return n.startStatus(engineID)(timeout)
}

// startStatus sends the engine actor a status query now (so the answer
// reflects every message handled before) and returns the wait for it.
func (n *Node) startStatus(engineID string) func(timeout time.Duration) (StatusReply, error) {
	rec := n.engine(engineID)
	if rec == nil {
		return func(time.Duration) (StatusReply, error) {
			return StatusReply{}, fmt.Errorf("%w %q", errUnknownEngine, engineID)
		}
	}
	ch := make(chan engine.Status, 1)
	n.system.Root.Send(rec.pid, &engine.StatusQuery{Reply: ch})
	return func(timeout time.Duration) (StatusReply, error) {
		select {
		case st := <-ch:
			return StatusReply{Status: st, Pool: n.poolStats(), SlotBytes: n.slotBytesNow(),
				StatusPage: StatusPage{Pages: 1, TotalRequests: len(st.Requests)}}, nil
		case <-time.After(timeout):
			return StatusReply{}, fmt.Errorf("engine %q did not answer status within %v", engineID, timeout)
		}
	}
}

// Engines lists registered engine ids.
func (n *Node) Engines() []string {
	n.mu.Lock()
	defer n.mu.Unlock()
	ids := make([]string, 0, len(n.engines))
	for id := range n.engines {
		ids = append(ids, id)
	}
	return ids
}

// onStatus answers P.E.status. The query reaches the engine actor after
// every batch the engine sent before it; the answer is awaited off the
// ingest worker so a slow gather never holds up events.
func (n *Node) onStatus(engineID string, m *nats.Msg) {
	page, err := decodeStatusQuery(m.Data)
	if err != nil {
		n.rejected(ingest.Reason(err), "status request refused", "engine", engineID, "err", err)
		n.outbox.Reply(context.Background(), m.Reply, StatusReply{Status: engine.Status{Engine: engineID},
			Error: err.Error()})
		return
	}
	wait := n.startStatus(engineID)
	go func() {
		st, err := wait(2 * time.Second)
		if err != nil {
			st.Engine, st.Error = engineID, err.Error()
		}
		n.outbox.Reply(context.Background(), m.Reply, n.statusPage(st, page))
	}()
}
