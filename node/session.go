package node

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"time"

	"github.com/kvactors/kvactors/actors/engine"
	"github.com/kvactors/kvactors/messages"
)

// newBoot is a random boot id: a restarted node is told apart from the one
// before it (PROTOCOL.md "Node identity").
func newBoot() string {
	var b [8]byte
	_, _ = rand.Read(b[:]) // crypto/rand.Read never fails (Go 1.24+)
	return hex.EncodeToString(b[:])
}

// hello announces this node: at start and after every reconnect.
func (n *Node) hello() {
	n.outbox.Node(n.cfg.NodeID, messages.NodeVerbHello,
		messages.Hello{Node: n.cfg.NodeID, Boot: n.boot, LeaseMS: n.cfg.Lease.Milliseconds()})
}

// sessionLoop runs every Lease/4 until ctx ends: each engine's lease
// check, and the resyncs owed for batches the intake dropped. (The node
// heartbeat goes out from the pinger: see beat.)
func (n *Node) sessionLoop(ctx context.Context) {
	defer n.loops.Done()
	t := time.NewTicker(n.cfg.Lease / 4)
	defer t.Stop()
	for {
		select {
		case <-ctx.Done():
			return
		case <-t.C:
		}
		recs := n.liveEngines()
		n.tellEngines(recs, &engine.Tick{})
		n.ingest.flushLost()
		n.rejectLog.Flush() // isolation: rate-limited rejection summaries
		n.outbox.FlushLog() // and of messages lost to publish errors
	}
}

// beatStats is the pool's and disk's part of a node heartbeat.
type beatStats struct{ pool, capacity, disk int64 }

// statsLoop gathers what the node heartbeat reports of the pool and disk
// every Lease/8, so the heartbeat never waits on their locks: engines judge
// the node by its heartbeats, and the disk holds its lock across file
// operations that a slow filesystem can stretch to seconds.
func (n *Node) statsLoop(ctx context.Context) {
	defer n.loops.Done()
	t := time.NewTicker(n.cfg.Lease / 8)
	defer t.Stop()
	for {
		pool := n.poolStats()
		st := beatStats{pool: pool.Data, capacity: pool.Capacity}
		if n.disk != nil {
			st.disk = n.disk.Stats().Bytes
		}
		n.beatStats.Store(&st)
		select {
		case <-ctx.Done():
			return
		case <-t.C:
		}
	}
}

// pinger measures round trips with NATS for the fence, and publishes the
// node heartbeat every other one (every Lease/4): each completed flush
// proves the server heard the node at the time the flush was sent, and had
// the heartbeat published before it.
//
// The heartbeat goes out here, not from a loop of its own, because engines
// judge the node by it: a node whose heartbeats stall while its round
// trips go on (a loop held up on a lock) would be declared lost by its
// engines while its fence still let copies start. With both on one
// goroutine, and the fence counting from no later than the last heartbeat
// plus its period (ping), a stall of either ages the fence.
func (n *Node) pinger(ctx context.Context) {
	defer n.loops.Done()
	period := n.cfg.Lease / 8
	t := time.NewTicker(period)
	defer t.Stop()
	for i := 0; ; i++ {
		select {
		case <-ctx.Done():
			return
		case <-t.C:
		}
		if i%2 == 0 {
			n.beat()
		}
		_ = n.ping() // failed: the fence goes on counting from the last that completed
	}
}

// beat publishes the node heartbeat. It takes no lock a slow path holds:
// the engine count and the pool's figures are kept for it (registered,
// statsLoop).
func (n *Node) beat() {
	var st beatStats
	if p := n.beatStats.Load(); p != nil {
		st = *p
	}
	// Stamped before the publish (the fence counts from no later than it);
	// taken back if the heartbeat did not go out (sealed, refused): the
	// fence must not count a heartbeat no engine got.
	now := time.Now()
	prev := n.lastBeat.Swap(&now)
	if !n.outbox.Node(n.cfg.NodeID, messages.NodeVerbHeartbeat,
		messages.NodeHeartbeat{Node: n.cfg.NodeID, Boot: n.boot, Engines: int(n.registered.Load()), LeaseMS: n.cfg.Lease.Milliseconds(),
			PoolBytes: st.pool, PoolCapacityBytes: st.capacity, DiskBytes: st.disk}) {
		n.lastBeat.CompareAndSwap(&now, prev)
	}
}

// ping makes one round trip with NATS and reports it to the fence when it
// completes: the completed flush proves the server heard the node at the
// time it was sent. An engine counts its lease from the last node message
// it heard, a heartbeat at the latest, so the fence is told no later than
// the last heartbeat's publish plus its period: a heartbeat overdue ages
// the fence as a round trip overdue does. Its error is the flush's
// (nothing reported then); the node's loops try again at their next period.
func (n *Node) ping() error {
	sent := time.Now()
	if err := n.nc.FlushTimeout(n.cfg.Lease / 2); err != nil {
		return err
	}
	if b := n.lastBeat.Load(); b != nil {
		if due := b.Add(n.cfg.Lease / 4); due.Before(sent) {
			sent = due
		}
	}
	n.fence.RoundTrip(sent)
	return nil
}

// watchdog records a lapse that no round trip reveals (NATS still down:
// transfer.Fence.Check), and fail-stops the process when a copy runs 5/8
// Lease past the last round trip (transfer.Fence.Overdue): an engine may already have declared this node
// lost and reused the blocks the copy reads or writes.
func (n *Node) watchdog(ctx context.Context) {
	defer n.loops.Done()
	t := time.NewTicker(n.cfg.Lease / 8)
	defer t.Stop()
	for {
		select {
		case <-ctx.Done():
			return
		case <-t.C:
			now := time.Now() // not the tick's time: a starved goroutine's tick is stale
			n.fence.Check(now)
			if n.fence.Overdue(now) {
				n.cfg.FailStop("a device copy is running 5/8 of a lease after the last NATS round trip")
				return
			}
		}
	}
}

// lapsed runs once per lapse (transfer.Fence.OnLapse): no NATS round trip
// for 3/4 lease, so an engine may have declared this node lost and be
// reusing the blocks of its requests. Every engine resyncs and resets its
// requests (engine.Lapsed); their copies, stamped with the old session,
// never start (the fence refuses them).
func (n *Node) lapsed() {
	n.metrics.Transfer.FenceLapses.Inc()
	recs := n.liveEngines()
	n.log.Warn("NATS lapse: no round trip for 3/4 lease; engines may have declared this node lost: "+
		"copies of their sessions are refused, every engine resyncs and its requests are reset",
		"lease", n.cfg.Lease, "engines", len(recs))
	n.tellEngines(recs, &engine.Lapsed{})
}

// lapseEnded runs when a round trip ends a lapse (transfer.Fence.OnLapseEnd):
// every engine actor sends the resync order it held during the lapse now,
// not at its next batch or lease check.
func (n *Node) lapseEnded() {
	n.log.Info("NATS answers again after a lapse: engines are told to resync")
	n.tellEngines(n.liveEngines(), &engine.Lapsed{})
}

// tellEngines sends msg to each engine actor of recs.
func (n *Node) tellEngines(recs []*engineRec, msg any) {
	for _, rec := range recs {
		n.system.Root.Send(rec.pid, msg)
	}
}

// reconnected: batches published while the node was away may be lost, so
// every engine with a live epoch resyncs (reason reconnect), after a hello.
// A round trip comes first: it ends a lapse (transfer.Fence.RoundTrip), so
// the engine actors send the resync orders they held back during it
// (engine.Actor.lapse), and the epochs the engines begin on them get the
// new stamp.
func (n *Node) reconnected() {
	n.metrics.NATSEvents.WithLabelValues("reconnect").Inc()
	n.metrics.NATSConnected.Set(1)
	if n.outbox == nil || n.closed.Load() {
		return
	}
	n.outbox.Refresh() // another server may allow less per message
	_ = n.ping()       // failed, the fence stays as it is: the pinger tries again
	n.hello()
	n.reannounce() // kv_events may have been lost
	if n.cl != nil && n.cl.feed != nil {
		n.cl.feed.Reconnected() // kv_events of other nodes may have been missed
	}
	n.tellEngines(n.liveEngines(), &engine.Lost{Reason: messages.ResyncReconnect})
}

// Fenced reports whether device copies are held back now: no round trip
// with NATS for lease/2 (PROTOCOL.md "Fencing, node side").
func (n *Node) Fenced() bool { return n.fence.Fenced() }

func (n *Node) liveEngines() []*engineRec {
	n.mu.Lock()
	defer n.mu.Unlock()
	recs := make([]*engineRec, 0, len(n.engines))
	for _, rec := range n.engines {
		recs = append(recs, rec)
	}
	return recs
}
