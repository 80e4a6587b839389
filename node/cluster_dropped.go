package node

import (
	"context"
	"fmt"
	"sync"
	"time"

	"github.com/nats-io/nats.go"

	"github.com/kvactors/kvactors/messages"
)

// droppedEnginesMax bounds the engines a node remembers having dropped: the
// oldest is forgotten first (it has had the longest to hear it is unknown).
const droppedEnginesMax = 4096

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
	checking bool // the owner is being read (answerDropped)
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

// begin starts a read of id's owner and returns its drop's generation; ok
// is false when id is not remembered or a read is in flight already (the
// message that would wait for it goes unanswered: the engine heartbeats
// again within lease/4, and an answer read before it arrived could be
// stale for it).
func (d *droppedEngines) begin(id string) (gen uint64, ok bool) {
	d.mu.Lock()
	defer d.mu.Unlock()
	e := d.ids[id]
	if e == nil || e.checking {
		return 0, false
	}
	e.checking = true
	return e.gen, true
}

// end ends the read begun for gen and reports whether id is still that
// drop's: false if it was claimed (forgotten) meanwhile, and dropped again
// or not.
func (d *droppedEngines) end(id string, gen uint64) bool {
	d.mu.Lock()
	defer d.mu.Unlock()
	e := d.ids[id]
	if e == nil || e.gen != gen {
		return false
	}
	e.checking = false
	return true
}

// dropped records that this node no longer serves engine id, which it
// served: its messages are answered "unknown engine" while no other node
// owns it (answerDropped).
func (n *Node) dropped(id string) {
	if n.cl != nil {
		n.cl.dropped.add(id)
	}
}

// answerDropped answers m, a heartbeat of an engine the ownership gate
// silenced, with "unknown engine" if this node dropped that engine and no
// node owns it now, as a single node answers an engine it dropped
// (PROTOCOL.md "Sessions"), so the engine registers again. The owner is read
// from the bucket off the intake worker, one read per engine at a time.
//
// Heartbeats only: an engine (the SDK) acts on "unknown engine" in a
// heartbeat's reply only when it comes from the boot it registered with,
// so an answer that a stale read lets through after another node claimed
// the engine (a read racing the claim, or a lagging replica's direct get)
// is ignored there. A load, lookup or unregister settles on the first reply
// from any node: answered here, a load another node is still copying into
// would be taken for one that wrote nothing more, and the engine would
// reuse its blocks under that copy.
func (n *Node) answerDropped(engine, verb string, m *nats.Msg) {
	c := n.cl
	if c == nil || m.Reply == "" || verb != messages.VerbHeartbeat {
		return
	}
	gen, ok := c.dropped.begin(engine)
	if !ok {
		return // not dropped here, or a read is in flight
	}
	c.checks.Add(1)
	go func() {
		defer c.checks.Done()
		ctx, cancel := context.WithTimeout(c.closing, n.cfg.Lease)
		e, err := c.owners.Get(ctx, engine)
		cancel()
		switch {
		case !c.dropped.end(engine, gen):
			return // claimed meanwhile: its owner answers
		case err != nil:
			// Whether another node owns it cannot be told: silence, the
			// engine asks again.
			n.log.Debug("cluster: owner of a dropped engine not read", "engine", engine, "err", err)
			return
		case e != nil && e.Node != n.cfg.NodeID:
			c.dropped.forget(engine) // another node claimed it: its own to answer
			return
		case c.owners.Serving(engine, time.Now()):
			return // this node's own claim, made again while the read ran
		}
		// No record, or this node's own that it no longer serves (a release
		// that failed; the lease ends it): a register claims it.
		n.rejected(messages.RejectUnknownEngine, "heartbeat of an engine this node dropped", "engine", engine)
		n.replyError(context.Background(), m.Reply, fmt.Errorf("%w %q", errUnknownEngine, engine))
	}()
}
