package cluster

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"log/slog"
	"slices"
	"sync"
	"time"

	"github.com/nats-io/nats.go"

	"github.com/kvactors/kvactors/cluster/holders"
	"github.com/kvactors/kvactors/ingest"
	"github.com/kvactors/kvactors/messages"
)

// Headers a node sets on every P.E.kv_events it publishes (the protocol
// words are messages.HeaderNode and messages.HeaderBoot).
const (
	HeaderNode = messages.HeaderNode
	HeaderBoot = messages.HeaderBoot
)

// FeedStats counts what the feed refused, beside the index's own Stats.
type FeedStats struct {
	Unattributed uint64 // kv_events without node and boot headers
	BadMessages  uint64 // undecodable heartbeats, hellos or batches
	CatchUpFails uint64 // catch-ups that failed (retried on the next heartbeat)
}

// Feed keeps a holders.Index current from NATS: other nodes' kv_events,
// hellos and heartbeats, a key-set catch-up of every node that is new,
// rebooted or back from silence, and expiry of silent nodes. It is the
// building block the node's holder actor will wrap; until then it guards
// the index with a mutex.
type Feed struct {
	nc      *nats.Conn
	cfg     Config
	log     *slog.Logger
	metrics *Metrics
	subs    []*nats.Subscription

	mu       sync.Mutex
	x        *holders.Index
	stats    FeedStats
	catching map[string]bool // nodes with a catch-up in flight
	pending  map[string]bool // nodes whose key set must be (re)read
	// listening is when the feed last began to hear the cluster: its
	// start, or the connection's reconnect numbered reconnects. Silence
	// heard for less than a lease says nothing of a node (NodeLive).
	listening  time.Time
	reconnects uint64

	ctx    context.Context
	cancel context.CancelFunc
	wg     sync.WaitGroup
}

// StartFeed subscribes and starts the expiry loop; Close stops both.
// cfg.Node is this node, whose own messages are skipped (its pool answers
// for itself).
func StartFeed(nc *nats.Conn, cfg Config, log *slog.Logger, metrics *Metrics) (*Feed, error) {
	if err := cfg.Validate(); err != nil {
		return nil, err
	}
	ctx, cancel := context.WithCancel(context.Background())
	f := &Feed{nc: nc, cfg: cfg, log: log, metrics: metrics.orNew(), x: holders.New(cfg.Lease, cfg.MaxPeerKeys), catching: map[string]bool{}, pending: map[string]bool{}, ctx: ctx, cancel: cancel}
	for subj, h := range map[string]nats.MsgHandler{
		cfg.Prefix + ".*." + messages.VerbKVEvents:                        f.onKVEvents,
		messages.NodeSubject(cfg.Prefix, "*", messages.NodeVerbHeartbeat): f.onHeartbeat,
		messages.NodeSubject(cfg.Prefix, "*", messages.NodeVerbHello):     f.onHello,
	} {
		sub, err := nc.Subscribe(subj, h)
		if err != nil {
			f.Close()
			return nil, fmt.Errorf("subscribe %s: %w", subj, err)
		}
		f.subs = append(f.subs, sub)
	}
	// Heard from the server's side: the flush returns once it has the
	// subscriptions. A failure leaves the connection down or reconnecting,
	// which NodeLive answers for itself.
	_ = nc.FlushTimeout(cfg.Lease)
	f.listening, f.reconnects = time.Now(), nc.Stats().Reconnects
	f.wg.Add(1)
	go f.expireLoop()
	return f, nil
}

// Close unsubscribes and waits for the expiry loop and any catch-up.
func (f *Feed) Close() {
	for _, s := range f.subs {
		_ = s.Unsubscribe()
	}
	// Under mu: a heartbeat handler still running either saw the feed open
	// and added its catch-up to wg already, or sees it closed and starts none
	// (a wg.Add racing Wait at zero is a misuse of WaitGroup).
	f.mu.Lock()
	f.cancel()
	f.mu.Unlock()
	f.wg.Wait()
}

func (f *Feed) expireLoop() {
	defer f.wg.Done()
	t := time.NewTicker(f.cfg.Lease / 4)
	defer t.Stop()
	for {
		select {
		case <-f.ctx.Done():
			return
		case now := <-t.C:
			f.mu.Lock()
			gone := f.x.Expire(now)
			for _, n := range gone {
				delete(f.pending, n) // a node that comes back is new: caught up anyway
			}
			f.mu.Unlock()
			if len(gone) > 0 {
				f.log.Info("nodes gone: no heartbeat for the lease", "nodes", gone, "lease", f.cfg.Lease)
			}
		}
	}
}

func (f *Feed) onHeartbeat(m *nats.Msg) { f.heard(m, false) }

// onHello is onHeartbeat for a node's hello, which it sends at its start
// and after each of its reconnects, and always asks for its key set: its
// kv_events while it was cut off were lost, and it clears (and so makes
// others catch up on) only the namespaces an engine is registered in, so
// a chunk it evicted meanwhile from any other stayed counted here. The
// hello of a node still live here (a reconnect) starts none at once: its
// re-announce's clears follow it, and would cut a catch-up begun now short
// or call for a second; its next heartbeat, at most lease/4 later, starts
// one for both.
func (f *Feed) onHello(m *nats.Msg) { f.heard(m, true) }

// heard applies a node's heartbeat or hello, and starts a catch-up of the
// node when one is due (or was asked: hello) and none is running.
func (f *Feed) heard(m *nats.Msg, hello bool) {
	var hb messages.NodeHeartbeat // a hello has the same node and boot
	if err := json.Unmarshal(m.Data, &hb); err != nil || hb.Node == "" || hb.Boot == "" {
		f.count(func(s *FeedStats) { s.BadMessages++ })
		f.metrics.FeedRejected.WithLabelValues("bad_message").Inc()
		return
	}
	if hb.Node == f.cfg.Node {
		return
	}
	f.mu.Lock()
	need, err := f.x.Heartbeat(hb.Node, hb.Boot, time.Now())
	if err != nil {
		f.metrics.FeedRejected.WithLabelValues("refused").Inc()
	}
	if err == nil && (need || hello) {
		f.pending[hb.Node] = true
	}
	start := err == nil && f.pending[hb.Node] && !f.catching[hb.Node] && f.ctx.Err() == nil && (need || !hello)
	if start {
		delete(f.pending, hb.Node)
		f.catching[hb.Node] = true
		f.wg.Add(1)
	}
	f.mu.Unlock()
	if start {
		go f.catchUp(hb.Node, hb.Boot)
	}
}

// errAtCap ends a catch-up at the first page that met the node's cap
// (Config.MaxPeerKeys): later pages could add nothing, so a node announcing
// an unbounded key set costs one catch-up of about the cap. It is no
// failure to retry: the catch-up is finished, and the node's keys are its
// first in page order up to the cap (holders.Index.FinishCatchUp: none the
// pages did not list stays, so no key it evicted while its BlockRemoved
// was missed).
var errAtCap = errors.New("cluster: catch-up met the node's key cap")

// catchUp asks node for its key set, which replaces what the index held
// of it once every page is read (up to the node's cap: FinishCatchUp);
// removals and stores seen meanwhile win (see holders.Index.BeginCatchUp).
// A failure is counted and logged, and the node's next heartbeat retries.
func (f *Feed) catchUp(node, boot string) {
	defer f.wg.Done()
	defer func() {
		f.mu.Lock()
		delete(f.catching, node)
		f.mu.Unlock()
	}()
	f.mu.Lock()
	id, err := f.x.BeginCatchUp(node, boot)
	f.mu.Unlock()
	if err != nil {
		return
	}
	defer func() {
		f.mu.Lock()
		f.x.EndCatchUp(node, id)
		f.mu.Unlock()
	}()
	err = CatchUp(f.ctx, f.nc, f.cfg.Prefix, node, f.cfg.FetchTimeout, func(b string, keys []holders.NSKey) error {
		if b != boot {
			return fmt.Errorf("%w: node %s answered for boot %s, not %s", ErrCatchUp, node, b, boot)
		}
		// Only keys of a geometry-qualified namespace count (a node of an
		// older version pages plain ones): see onKVEvents.
		keys = slices.DeleteFunc(keys, func(k holders.NSKey) bool {
			_, _, ok := messages.SplitClusterNamespace(k.NS)
			return !ok
		})
		f.mu.Lock()
		res, err := f.x.CatchUpPage(node, id, keys)
		f.mu.Unlock()
		if err != nil {
			return err
		}
		if f.overCap(node, boot, "catch-up", res) {
			return errAtCap
		}
		return nil
	})
	switch {
	case err == nil || errors.Is(err, errAtCap):
		f.mu.Lock()
		f.x.FinishCatchUp(node, id)
		f.mu.Unlock()
		f.metrics.CatchUps.WithLabelValues("ok").Inc()
	case errors.Is(err, context.Canceled):
	case errors.Is(err, holders.ErrNoSync):
		// Superseded, not failed: the node cleared a namespace meanwhile
		// (the AllBlocksCleared of its reconnect's re-announce, or of
		// deferred changes dropped: its pages may list keys whose removal
		// was lost), rebooted, or
		// expired. The clear and a new boot have it caught up again at its
		// next heartbeat; marked here too, as a failure is.
		f.mu.Lock()
		f.pending[node] = true
		f.mu.Unlock()
		f.metrics.CatchUps.WithLabelValues("superseded").Inc()
		f.log.Debug("key catch-up superseded: caught up again at the node's next heartbeat", "node", node, "boot", boot,
			"err", err)
	default:
		f.mu.Lock()
		f.pending[node] = true
		f.stats.CatchUpFails++
		f.mu.Unlock()
		f.metrics.CatchUps.WithLabelValues("error").Inc()
		f.log.Warn("key catch-up failed", "node", node, "boot", boot, "err", err)
	}
}

// Reconnected marks every known node for catch-up: while this node was
// away from NATS it may have missed their kv_events. Wire it to the
// connection's reconnect handler.
func (f *Feed) Reconnected() {
	rc := f.nc.Stats().Reconnects
	f.mu.Lock()
	defer f.mu.Unlock()
	now := time.Now()
	f.listen(rc, now)
	for _, n := range f.x.Nodes(now) {
		f.pending[n.Node] = true
	}
}

// Dropped reports whether sub is one of the feed's subscriptions and, if
// so, marks every known node for catch-up: NATS dropped messages of it (a
// slow consumer), so kv_events may have been lost and keys would be
// counted that their node evicted, or missed that it stored. Wire it to
// the connection's error handler for nats.ErrSlowConsumer.
func (f *Feed) Dropped(sub *nats.Subscription) bool {
	if sub == nil || !slices.Contains(f.subs, sub) {
		return false
	}
	f.mu.Lock()
	defer f.mu.Unlock()
	for _, n := range f.x.Nodes(time.Now()) {
		f.pending[n.Node] = true
	}
	return true
}

// listen restarts the listening time once the connection has reconnected
// (rc is its reconnect count): what was said meanwhile went unheard. Under
// mu.
func (f *Feed) listen(rc uint64, now time.Time) {
	if rc != f.reconnects {
		f.reconnects, f.listening = rc, now
	}
}

// NodeLive reports whether node may be alive, as a standby must know
// before it takes the node's engines (PROTOCOL.md "Clusters": only once N
// "has sent no hello or heartbeat for a lease"). A node heard within the
// lease is live; so is every node while this feed has not listened for a
// whole lease (since it started or the connection last reconnected) or is
// cut off from NATS: a node not heard then may be heartbeating unheard.
func (f *Feed) NodeLive(node string) bool {
	// The reconnect count is read before the state: a register received
	// after a reconnect was delivered after the count rose (nats.go counts
	// it before it resends the subscriptions).
	rc := f.nc.Stats().Reconnects
	connected := f.nc.IsConnected()
	f.mu.Lock()
	defer f.mu.Unlock()
	now := time.Now()
	f.listen(rc, now)
	if !connected || now.Sub(f.listening) < f.cfg.Lease {
		return true
	}
	for _, n := range f.x.Nodes(now) {
		if n.Node == node {
			return n.Live
		}
	}
	return false
}

func (f *Feed) onKVEvents(m *nats.Msg) {
	node, boot := m.Header.Get(HeaderNode), m.Header.Get(HeaderBoot)
	if node == "" || boot == "" {
		f.count(func(s *FeedStats) { s.Unattributed++ })
		f.metrics.FeedRejected.WithLabelValues("unattributed").Inc()
		return
	}
	if node == f.cfg.Node {
		return
	}
	engine, _, err := ingest.ParseSubject(f.cfg.Prefix, m.Subject)
	var b messages.KVEventBatch
	if err == nil {
		err = json.Unmarshal(m.Data, &b)
	}
	if err != nil {
		f.count(func(s *FeedStats) { s.BadMessages++ })
		f.metrics.FeedRejected.WithLabelValues("bad_message").Inc()
		return
	}
	// A key names the same bytes only under its namespace's geometry: a
	// batch that does not say it (a node of an older version) adds no
	// holder for anyone; a clear in it names none of the keys held (keyed
	// without a geometry) and only asks for the node's key set again.
	geo, stamped := messages.ParseGeometryHex(m.Header.Get(messages.HeaderGeometry))
	if !stamped {
		all := len(b.Events)
		b.Events = slices.DeleteFunc(b.Events, func(ev messages.KVEvent) bool { return ev.Type != messages.KVAllBlocksCleared })
		if len(b.Events) < all {
			f.metrics.FeedRejected.WithLabelValues("no_geometry").Inc()
		}
	}
	f.mu.Lock()
	res, err := f.x.ApplyKVEvents(node, boot, engine, geo, b) // unstamped: clears only, which name no key
	if res.Cleared || res.Abandoned {
		// The index dropped the node's keys of a namespace it cleared (its
		// changes lost or dropped: those still held come back with the
		// key set), or gave up its catch-up (removals past the cap
		// meanwhile): read its key set again at its next heartbeat.
		f.pending[node] = true
	}
	f.mu.Unlock()
	if err != nil {
		f.metrics.FeedRejected.WithLabelValues("refused").Inc()
		f.log.Debug("kv_events refused", "node", node, "engine", engine, "err", err)
	}
	f.overCap(node, boot, "kv_events", res)
}

// overCap counts the keys of node an input left out at its cap and logs the
// crossing (once until the node's keys are whole again, not per key or per
// batch); it reports whether any were left out.
func (f *Feed) overCap(node, boot, via string, res holders.Applied) bool {
	if res.OverCap == 0 {
		return false
	}
	f.metrics.KeysOverCap.Add(float64(res.OverCap))
	if res.Capped {
		f.log.Warn("node met the holders cap: its keys past it are not indexed (raise --cluster-max-peer-keys if its pool holds that many)",
			"node", node, "boot", boot, "cap", f.cfg.MaxPeerKeys, "via", via)
	}
	return true
}

func (f *Feed) count(inc func(*FeedStats)) {
	f.mu.Lock()
	inc(&f.stats)
	f.mu.Unlock()
}

// Holders returns the live nodes other than this one holding ns/key.
func (f *Feed) Holders(ns string, key messages.Key) []string {
	f.mu.Lock()
	defer f.mu.Unlock()
	return f.x.Holders(ns, key, time.Now())
}

// Nodes lists the nodes the feed knows.
func (f *Feed) Nodes() []holders.NodeInfo {
	f.mu.Lock()
	defer f.mu.Unlock()
	return f.x.Nodes(time.Now())
}

// Stats returns the feed's and the index's counters.
func (f *Feed) Stats() (FeedStats, holders.Stats) {
	f.mu.Lock()
	defer f.mu.Unlock()
	return f.stats, f.x.Stats()
}
