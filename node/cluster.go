package node

import (
	"context"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"sync"
	"sync/atomic"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"

	"github.com/kvactors/kvactors/actors"
	"github.com/kvactors/kvactors/backend"
	"github.com/kvactors/kvactors/cluster"
	"github.com/kvactors/kvactors/cluster/holders"
	"github.com/kvactors/kvactors/cluster/ownership"
	"github.com/kvactors/kvactors/messages"
)

// clusterNode is a node's part in a cluster (docs/CLUSTER.md): ownership of
// the engines it serves, the index of what other nodes hold, the fetch
// client, and the fetch and key-set servers over its own pool.
type clusterNode struct {
	cfg     cluster.Config
	metrics *cluster.Metrics
	owners  *cluster.Owners
	feed    *cluster.Feed
	fetcher *cluster.Fetcher
	subs    []*nats.Subscription
	keys    *heldKeys
	recent  recentChunksCache
	// Close waits for both before the pool is unmapped: a remote load
	// writes fetched bytes into the pool (fetches, cancelled through
	// closing), and a fetch served reads them (reads). Unsubscribing
	// waits for neither, and a retired engine's loads are not waited for.
	fetches loadGate
	reads   loadGate
	// dropped: engines this node served and dropped, answered "unknown
	// engine" while nobody owns them; checks: their owner reads in flight.
	dropped droppedEngines
	checks  sync.WaitGroup
	closing context.Context
	close   context.CancelFunc
	// stopKeepAlive ends ownershipLoop and keepAliveDone closes once it
	// has: Close waits for it before it leaves its claims, so no keep-alive
	// lands after a closed marker, or races one (its claim, given up
	// meanwhile, would delete the record, the marker lost).
	stopKeepAlive context.CancelFunc
	keepAliveDone chan struct{}
	// inGate holds nil but in tests (export_test.go): a func run inside the
	// gates above, "read" as readChunk serves a fetch, "remote-load" as a
	// remote load's goroutine starts, "fetch" as a
	// remote load's fetch allocates a chunk's room, and "claim-released" as an
	// ended engine's claim has just been released (releaseClaimIfGone).
	inGate atomic.Pointer[func(gate string)]
	// onClaim holds nil but in tests (export_test.go): a func run as a
	// register's claim begins, with the context its JetStream calls get.
	onClaim atomic.Pointer[func(ctx context.Context, engine string)]
}

// Clustered reports whether clustering is on (--cluster or --standby-for).
func (c Config) Clustered() bool { return c.Cluster || c.StandbyFor != "" }

func (c Config) clusterConfig(boot string) cluster.Config {
	return cluster.Config{Prefix: c.Prefix, Bucket: c.ClusterBucket, Replicas: c.ClusterReplicas, Lease: c.Lease,
		Node: c.NodeID, Boot: boot, StandbyFor: c.StandbyFor, FetchWindow: c.FetchWindow, FetchTimeout: c.FetchTimeout,
		MaxPeerKeys: c.ClusterMaxPeerKeys, ClockSkew: c.ClusterClockSkew}
}

// startCluster joins the cluster: it opens the ownership bucket, starts the
// holders feed and serves fetch and keys. It runs after the outbox exists
// and before the node subscribes to engines and starts the kv_events
// journal, so every kv_events batch is stamped with this node and boot.
// The bucket's JetStream requests end with ctx (Start's: a SIGTERM during
// start), not only at their own 30 s bound.
func (n *Node) startCluster(ctx context.Context) error {
	if !n.cfg.Clustered() {
		return nil
	}
	cfg := n.cfg.clusterConfig(n.boot)
	if err := cfg.Validate(); err != nil { // fills the defaults
		return err
	}
	c := &clusterNode{cfg: cfg, metrics: cluster.NewMetrics(n.cfg.Registry), keys: newHeldKeys()}
	c.closing, c.close = context.WithCancel(context.Background())
	n.cl = c
	js, err := jetstream.New(n.nc)
	if err != nil {
		return fmt.Errorf("cluster: jetstream: %w", err)
	}
	ctx, cancel := context.WithTimeout(ctx, 30*time.Second)
	defer cancel()
	c.owners, err = cluster.OpenOwners(ctx, js, cfg, c.metrics)
	switch {
	case errors.Is(err, cluster.ErrConfig):
		// This node's settings against the bucket's (another --lease or
		// --cluster-replicas): configuration, which a restart cannot fix.
		return configError{err}
	case err != nil:
		return fmt.Errorf("cluster (JetStream is needed: --nats to a cluster with JetStream, or the embedded server): %w", err)
	}
	// Engines a previous process of this node id served: it is dead, and
	// their records keep every other node silent, so without an answer here
	// an engine would only suspect the new boot (its hello proves nothing)
	// and declare its node lost after a lease of no heartbeat from the old
	// one, then wait a lease more. Told "unknown engine" like any engine
	// this node dropped (answerDropped), it sees the restart at once, waits
	// one lease (its frees: the old process's fence) and registers, and the
	// claim takes its record back by CAS (ownership.Decide, "previous
	// boot"). Only a speed-up: a failed read is logged, not fatal.
	if past, err := c.owners.PastBoots(ctx); err != nil {
		n.log.Warn("cluster: engines of this node's previous boot not read: they find it at their lease",
			"err", err)
	} else {
		for _, id := range past {
			c.dropped.add(id)
		}
	}
	n.outbox.SetKVStamp(&actors.KVStamp{Node: cfg.Node, Boot: n.boot})
	n.kv.observe = c.keys.observe // the journal starts after this
	log := n.log.With("part", "cluster")
	if c.feed, err = cluster.StartFeed(n.nc, cfg, log, c.metrics); err != nil {
		return err
	}
	n.slow.add(c.feed.Dropped) // kv_events lost: catch the nodes up again
	if c.fetcher, err = cluster.NewFetcher(n.nc, cfg, c.metrics); err != nil {
		return err
	}
	s, err := cluster.ServeFetch(n.nc, cfg.Prefix, cfg.Node, cluster.ChunkSourceFunc(n.readChunk), c.metrics)
	if err != nil {
		return err
	}
	c.subs = append(c.subs, s)
	if s, err = cluster.ServeKeys(n.nc, cfg.Prefix, cfg.Node, n.boot, c.keys); err != nil {
		return err
	}
	c.subs = append(c.subs, s)
	return nil
}

// closeCluster gives up every claim, leaving a closed marker (Owners.Leave):
// another node claims at the engines' next registers without waiting out
// the lease, and this node's next boot tells them of the restart at once
// (startCluster's previous-boot read), no later than after a crash. Then it
// stops the feed and the fetch and key servers, cancels the fetches of
// remote loads, and waits for those and for fetches being served: both
// touch the pool, which the teardown unmaps.
func (n *Node) closeCluster(ctx context.Context) {
	c := n.cl
	if c == nil {
		return
	}
	defer func() {
		c.close()
		c.checks.Wait()          // owner reads of dropped engines, cancelled (the intake is stopped: no new ones)
		c.fetches.closeAndWait() // cancelled: a piece's round trip, a copy into the pool
		c.reads.closeAndWait()   // a copy out of the pool and its checksum
	}()
	if c.stopKeepAlive != nil {
		c.stopKeepAlive()
		<-c.keepAliveDone
	}
	if c.owners != nil && n.nc != nil {
		n.leaveAll(ctx)
	}
	for _, s := range c.subs {
		_ = s.Unsubscribe()
	}
	if c.feed != nil {
		c.feed.Close()
	}
}

// leaveAll leaves a closed marker for every engine this node owns, for at
// most half a lease and only while NATS is up. A record lapses a lease
// after its last keep-alive (the bucket's TTL), sent a quarter of a lease
// apart: a marker much later could not land. A Leave with no answer to
// come (the connection down, JetStream without a quorum) waited out the
// whole shutdown timeout (a link cut as Close began held a shutdown 10 s;
// Close confirms its releases before, so they do not wait on this). A
// marker not left, the next boot and the other nodes find the record as
// after a crash.
func (n *Node) leaveAll(ctx context.Context) {
	c := n.cl
	ctx, cancel := context.WithTimeout(ctx, n.cfg.Lease/2)
	defer cancel()
	down, unwatch := n.watchDown()
	defer unwatch()
	if !n.nc.IsConnected() { // checked after down's registration: no loss unseen
		if mine := c.owners.Mine(); len(mine) > 0 {
			n.log.Warn("cluster: shutdown: closed markers not left, NATS is down; the records lapse after a lease", "engines", len(mine))
		}
		return
	}
	go func() {
		select {
		case <-down: // or closed, once the pass is over
			cancel()
		case <-ctx.Done():
		}
	}()
	mine := c.owners.Mine()
	for i, id := range mine {
		if ctx.Err() != nil {
			n.log.Warn("cluster: shutdown: closed markers not left; the records lapse after a lease", "engines", len(mine)-i, "err", ctx.Err())
			return
		}
		if err := leaveEngine(c.owners, ctx, id); err != nil {
			n.log.Warn("cluster: release on shutdown", "engine", id, "err", err)
		}
	}
}

// leaveEngine leaves a closed marker for an engine in closeCluster (a seam:
// a test cuts NATS there, or answers never).
var leaveEngine = (*cluster.Owners).Leave

// serving is the ownership gate for every engine message but register:
// only the owner, within its lease, answers or applies it; every other node
// stays silent and counts it.
func (n *Node) serving(engine, verb string) bool {
	if n.cl == nil {
		return true
	}
	if n.cl.owners.Serving(engine, time.Now()) {
		n.cl.metrics.Decisions.WithLabelValues(ownership.Serve.String()).Inc()
		return true
	}
	n.cl.metrics.Decisions.WithLabelValues(ownership.Ignore.String()).Inc()
	n.log.Debug("cluster: message of an engine this node does not own ignored", "engine", engine, "verb", verb)
	return false
}

// claimRegister decides a register on a cluster: true if this node serves
// the engine (it owned it or won the claim). A refusal is answered here;
// every other outcome is silence. It runs off the intake's shard worker
// (registerClaimed); halt ends it early when the intake stops.
func (n *Node) claimRegister(ctx, halt context.Context, id string, spec messages.EngineSpec, reply string) bool {
	c := n.cl
	rctx, cancel := context.WithTimeout(ctx, n.cfg.Lease)
	defer cancel()
	defer context.AfterFunc(halt, cancel)()
	if halt.Err() != nil {
		return false // the intake stopped before this claim began (AfterFunc cancels on a goroutine of its own: too late for Resolve)
	}
	if f := c.onClaim.Load(); f != nil {
		(*f)(rctx, id)
	}
	d, err := c.owners.Resolve(rctx, id, cluster.Request{Register: true, SpecNode: spec.Node,
		Local: n.localMemory(spec), NamedLive: c.live(spec.Node), StandbyForLive: c.live(n.cfg.StandbyFor)})
	switch {
	case err != nil && halt.Err() != nil:
		n.log.Debug("cluster: register not decided: intake stopped", "engine", id, "err", err)
		return false
	case err != nil:
		// Another node may hold or win it; an error reply from every node
		// that could not read the bucket would be noise. The engine retries.
		n.log.Warn("cluster: register not decided", "engine", id, "err", err)
		return false
	case d.Action == ownership.Refuse:
		// Rate-limited: the engine chooses how often it is refused.
		n.rejected(messages.RejectBadSpec, "cluster: register refused: names another node", "engine", id, "named", spec.Node)
		n.replyError(ctx, reply, errors.New(ownership.RefusalError(n.cfg.NodeID, spec.Node)))
		return false
	case d.Action != ownership.Serve:
		n.log.Debug("cluster: register left to another node", "engine", id, "owner", d.Owner, "reason", d.Reason)
		return false
	}
	c.dropped.forget(id) // served here again
	return true
}

// errUnnamedDevice refuses an engine on a cluster whose memory no node can
// locate: a CUDA IPC handle says nothing of the host it came from, so
// without "node" every cuda node would claim it and all but the one on its
// host would fail to open it, at random (docs/CLUSTER.md).
var errUnnamedDevice = fmt.Errorf("%w: an engine with CUDA memory on a cluster must name its node (\"node\" in the spec): a CUDA IPC handle does not say which host it is from", ErrRegister)

// locatable refuses, before any claim, a spec with CUDA memory that names
// no node: no node can tell its host. It reads the spec alone, so every
// node of a cluster, cuda or shm, answers such a register alike and any
// other not at all (an shm node locates a spec by its segment names:
// localMemory).
func (n *Node) locatable(spec messages.EngineSpec) error {
	if spec.Node != "" {
		return nil
	}
	for _, s := range spec.Segments {
		if s.CUDAIPC != "" {
			return errUnnamedDevice
		}
	}
	return nil
}

// localMemory: this node can copy for the engine (shm segments exist in
// its shm dir; on the cuda backend the spec names its node, locatable, and
// the name decides). Only for a
// spec whose segment names are the engine's (ingest.CheckOwner, checked
// first in onRegister): whether a name exists here decides whether this
// node claims, and so answers.
func (n *Node) localMemory(spec messages.EngineSpec) bool {
	if n.cfg.Backend != "shm" {
		return true
	}
	for _, s := range spec.Segments {
		if s.Shm == "" || !n.backendHas(s.Shm) {
			return false
		}
	}
	return len(spec.Segments) > 0
}

// backendHas reports whether shmName is a regular file in the shm dir; a
// symbolic link is not followed (the backend refuses one at attach), so
// its target's existence says nothing.
func (n *Node) backendHas(shmName string) bool {
	fi, err := os.Lstat(filepath.Join(n.cfg.ShmDir, shmName))
	return err == nil && fi.Mode().IsRegular()
}

// live reports whether node may be alive: heard within the lease, or not
// heard by a feed that has not listened for a lease yet
// (cluster.Feed.NodeLive). A standby just started, or just back on NATS,
// has heard nobody; it must not take its primary's engines for that.
func (c *clusterNode) live(node string) bool {
	return node != "" && c.feed.NodeLive(node)
}

// ownershipLoop renews this node's claims every lease/4 (on its own
// goroutine: a JetStream stall must not delay heartbeats). A NATS error is
// retried every 100 ms until the next tick; an engine whose claim was
// fenced (another node wrote its record) is dropped at once.
func (n *Node) ownershipLoop(ctx context.Context, done chan<- struct{}) {
	defer n.loops.Done()
	defer close(done)
	period := n.cfg.Lease / 4
	t := time.NewTicker(period)
	defer t.Stop()
	for {
		select {
		case <-ctx.Done():
			return
		case <-t.C:
		}
		next := time.Now().Add(period)
		for {
			wctx, cancel := context.WithDeadline(ctx, next)
			lost, err := n.cl.owners.KeepAliveAll(wctx)
			cancel()
			for _, id := range lost {
				n.fenced(id)
			}
			if err == nil || time.Until(next) < 100*time.Millisecond {
				if err != nil {
					n.log.Warn("cluster: keep-alive failed", "err", err)
				}
				break
			}
			if !pause(ctx, 100*time.Millisecond) {
				return
			}
		}
	}
}

// pause waits d, or less if ctx ends: it reports whether the wait ran out.
func pause(ctx context.Context, d time.Duration) bool {
	t := time.NewTimer(d)
	defer t.Stop()
	select {
	case <-ctx.Done():
		return false
	case <-t.C:
		return true
	}
}

// fenced drops an engine another node now owns: as an expiry, with no one
// to reply to (the engine resyncs with its new owner).
func (n *Node) fenced(id string) {
	n.log.Warn("cluster: ownership lost (fenced): dropping engine", "engine", id)
	rec := n.detach(id, nil)
	if rec == nil {
		return
	}
	go func() {
		wait, cancel := context.WithTimeout(context.Background(), n.cfg.ShutdownTimeout)
		defer cancel()
		if _, err := n.end(wait, rec, nil); err != nil {
			n.log.Error("cluster: drop fenced engine", "engine", id, "err", err)
			<-rec.closed             // its copies, still running, end first
			rec.loads.closeAndWait() // and its loads (a remote fetch outlives the actor)
		}
		// The record may be gone rather than another node's (it lapsed
		// while the keep-alives failed): then nobody owns the engine, and
		// only this node can tell it so. Only once its copies have ended
		// (the end waited for them): told "unknown engine", the engine
		// registers again, maybe elsewhere, and a new node would release
		// its requests at once, their blocks then reused under a copy of
		// this node's still running. Under the claim lock, and only if the
		// engine has not registered here again meanwhile: a late mark would
		// have this node tell an engine it serves that it is unknown.
		unlock := n.claimLock(id)
		defer unlock()
		if n.engine(id) == nil {
			n.dropped(id)
		}
	}()
}

// claimLock locks the claim of engine id against a concurrent register or
// release of it; it returns the unlock. The lock is the id's own: it is
// held across JetStream calls, and another engine's register must not wait
// on them.
func (n *Node) claimLock(id string) func() { return n.claims.lock(id) }

// keyedLocks is a mutex per key, kept while someone holds or waits for it.
type keyedLocks struct {
	mu   sync.Mutex
	keys map[string]*keyedLock
}

type keyedLock struct {
	mu   sync.Mutex
	refs int // holders and waiters
}

func (k *keyedLocks) lock(key string) (unlock func()) {
	k.mu.Lock()
	if k.keys == nil {
		k.keys = map[string]*keyedLock{}
	}
	l := k.keys[key]
	if l == nil {
		l = &keyedLock{}
		k.keys[key] = l
	}
	l.refs++
	k.mu.Unlock()
	l.mu.Lock()
	return func() {
		l.mu.Unlock()
		k.mu.Lock()
		if l.refs--; l.refs == 0 {
			delete(k.keys, key)
		}
		k.mu.Unlock()
	}
}

// releaseClaimIfGone gives up the claim on an engine that has ended here
// (unregister, expiry), unless it has registered again meanwhile: its end
// ran for a while (copies in flight), and the engine, told it is unknown,
// may have registered at once, claiming under its old claim. Under the
// claim lock, so a register cannot claim between the check and the
// release.
func (n *Node) releaseClaimIfGone(id string) {
	if n.cl == nil {
		return
	}
	defer n.claimLock(id)()
	if n.engine(id) != nil {
		return
	}
	// Marked before the release: once the bucket shows no owner, its
	// messages pass no node's gate, and this node must already be the one
	// that tells it it is unknown (marked after, a heartbeat that came in
	// between went unanswered; until the release, the claim answers it).
	n.dropped(id)
	n.releaseClaim(id)
	if f := n.cl.inGate.Load(); f != nil {
		(*f)("claim-released")
	}
}

// releaseClaimWhenClosed releases an ended engine's claim (if it did not
// register again) once its actor has stopped, however late: an end that
// timed out would otherwise leave the claim renewed for an engine this node
// no longer serves, refusing it everywhere else.
func (n *Node) releaseClaimWhenClosed(rec *engineRec) {
	if n.cl == nil {
		return
	}
	<-rec.closed
	n.releaseClaimIfGone(rec.id)
}

// releaseClaim gives up the claim on an engine this node no longer serves.
func (n *Node) releaseClaim(id string) {
	if n.cl == nil {
		return
	}
	ctx, cancel := context.WithTimeout(context.Background(), n.cfg.Lease)
	defer cancel()
	if err := n.cl.owners.Release(ctx, id); err != nil && !errors.Is(err, cluster.ErrNotMine) {
		n.log.Warn("cluster: release", "engine", id, "err", err)
	}
}

// errNotOwner: a copy refused because this node may no longer serve the
// engine.
var errNotOwner = errors.New("cluster: this node no longer owns the engine")

// ownedDevice refuses every copy once this node's claim on the engine may
// have lapsed (Owners.Serving): after that another node may own the engine
// and reuse its blocks. It joins the session fence (no copy past lease/2
// without a NATS round trip) for the case NATS answers but the bucket does
// not. Without a cluster the device is returned as it is.
func (n *Node) ownedDevice(engine string, dev backend.Attachment) backend.Attachment {
	if n.cl == nil {
		return dev
	}
	return &ownedDev{Attachment: dev, engine: engine, serving: func() bool { return n.cl.owners.Serving(engine, time.Now()) }}
}

type ownedDev struct {
	backend.Attachment
	engine  string
	serving func() bool
}

func (d *ownedDev) Copy(dir backend.Direction, arena backend.Arena, ranges []backend.Range) error {
	if !d.serving() {
		return fmt.Errorf("%w: engine %s: copy refused", errNotOwner, d.engine)
	}
	return d.Attachment.Copy(dir, arena, ranges)
}

// ClusterNodes lists the other nodes this node's holders index knows (nil
// when not clustered).
func (n *Node) ClusterNodes() []holders.NodeInfo {
	if n.cl == nil || n.cl.feed == nil {
		return nil
	}
	return n.cl.feed.Nodes()
}
