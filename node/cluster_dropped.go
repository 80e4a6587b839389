package node

import (
	"context"
	"fmt"
	"sync"

	"github.com/nats-io/nats.go"

	"github.com/kvactors/kvactors/messages"
)

// droppedEnginesMax bounds the engines a node remembers having dropped: the
// oldest is forgotten first (it has had the longest to hear it is unknown).
const droppedEnginesMax = 4096

// droppedWaitMax bounds the replies held for one engine while its owner is
// read: the engine heartbeats every lease/4, so more means a flood, and the
// rest stay unanswered (the engine asks again).
const droppedWaitMax = 8

// droppedEngines remembers the engines this node served and then dropped
// (an unregister, an expiry, a fenced or lapsed claim) until anyone claims
// them again. On a cluster the ownership gate silences every message of an
// engine this node does not own, so without it an engine whose claim was
// dropped while its node stayed alive (PROTOCOL.md "Sessions": the SDK
// judges its node by the node's heartbeats) would be answered by nobody and
// never register again (TestClusterIdleEngineRegistersAgainAfterItsClaimLapses).
// Safe for concurrent use.
type droppedEngines struct {
	mu    sync.Mutex
	gen   uint64
	ids   map[string]*droppedEngine
	queue []droppedRef // in the order added, oldest first; stale refs are skipped
}

type droppedEngine struct {
	gen      uint64
	checking bool     // the owner is being read (answerDropped)
	replies  []string // awaiting that read
}

type droppedRef struct {
	id  string
	gen uint64
}

// add remembers id as dropped here.
func (d *droppedEngines) add(id string) {
	d.mu.Lock()
	defer d.mu.Unlock()
	if d.ids == nil {
		d.ids = map[string]*droppedEngine{}
	}
	if d.ids[id] != nil {
		return
	}
	d.gen++
	d.ids[id] = &droppedEngine{gen: d.gen}
	d.queue = append(d.queue, droppedRef{id: id, gen: d.gen})
	for len(d.ids) > droppedEnginesMax {
		r := d.queue[0]
		d.queue = d.queue[1:]
		if e := d.ids[r.id]; e != nil && e.gen == r.gen {
			delete(d.ids, r.id)
		}
	}
	if len(d.queue) > 2*droppedEnginesMax { // refs of forgotten ids: compact
		q := make([]droppedRef, 0, len(d.ids))
		for _, r := range d.queue {
			if e := d.ids[r.id]; e != nil && e.gen == r.gen {
				q = append(q, r)
			}
		}
		d.queue = q
	}
}

// forget: id was claimed again (here or elsewhere).
func (d *droppedEngines) forget(id string) {
	d.mu.Lock()
	defer d.mu.Unlock()
	delete(d.ids, id)
}

// await queues reply for an answer about id: start is true when the caller
// must read the owner (no read in flight); false with queued when one is;
// !queued when id is not remembered (or too many replies wait).
func (d *droppedEngines) await(id, reply string) (start, queued bool) {
	d.mu.Lock()
	defer d.mu.Unlock()
	e := d.ids[id]
	if e == nil || len(e.replies) >= droppedWaitMax {
		return false, false
	}
	e.replies = append(e.replies, reply)
	if e.checking {
		return false, true
	}
	e.checking = true
	return true, true
}

// done ends the read of id's owner and returns the replies it owes; none
// if id was claimed meanwhile (forgotten).
func (d *droppedEngines) done(id string) []string {
	d.mu.Lock()
	defer d.mu.Unlock()
	e := d.ids[id]
	if e == nil {
		return nil
	}
	r := e.replies
	e.replies, e.checking = nil, false
	return r
}

// dropped records that this node no longer serves engine id, which it
// served: its messages are answered "unknown engine" while no other node
// owns it (answerDropped).
func (n *Node) dropped(id string) {
	if n.cl != nil {
		n.cl.dropped.add(id)
	}
}

// answerDropped answers m, a message of an engine the ownership gate
// silenced, with "unknown engine" if this node dropped that engine and no
// other node owns it now, as a single node answers an engine it dropped
// (PROTOCOL.md "Sessions"), so the engine registers again. The owner is read
// from the bucket off the intake worker. A read that lags a fresh claim
// elsewhere may answer an engine another node just took: the reply carries
// this node's boot, which is not its session's, and an engine acts on
// "unknown engine" only from the boot it registered with (client SDK).
// Register is never passed here; a message without a reply gets nothing.
func (n *Node) answerDropped(engine, verb string, m *nats.Msg) {
	c := n.cl
	if c == nil || m.Reply == "" || verb == messages.VerbRegister {
		return
	}
	if start, _ := c.dropped.await(engine, m.Reply); !start {
		return // not dropped here, or answered by the read in flight
	}
	c.checks.Add(1)
	go func() {
		defer c.checks.Done()
		ctx, cancel := context.WithTimeout(c.closing, n.cfg.Lease)
		e, err := c.owners.Get(ctx, engine)
		cancel()
		replies := c.dropped.done(engine)
		switch {
		case err != nil:
			// Whether another node owns it cannot be told: silence, the
			// engine asks again.
			n.log.Debug("cluster: owner of a dropped engine not read", "engine", engine, "err", err)
			return
		case e != nil && e.Node != n.cfg.NodeID:
			c.dropped.forget(engine) // another node claimed it: its own to answer
			return
		}
		// No record, or this node's own that it no longer serves (a release
		// that failed; the lease ends it): a register claims it.
		for _, r := range replies {
			n.rejected(messages.RejectUnknownEngine, "message of an engine this node dropped", "engine", engine)
			n.replyError(context.Background(), r, fmt.Errorf("%w %q", errUnknownEngine, engine))
		}
	}()
}
