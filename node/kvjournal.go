package node

import (
	"context"
	"iter"
	"slices"
	"sync"
	"time"

	"github.com/kvactors/kvactors/messages"
	"github.com/kvactors/kvactors/sched"
)

// kvJournal publishes kv_events in the order the host pool and the disk
// tier changed (PROTOCOL.md, "kv_events"). The pool tells it of every
// change to what is loadable under the pool's lock (hostpool.Journal), the
// disk tier of every write and deletion after the pool's eviction that
// caused it; one goroutine turns the records into events and publishes
// them in that order. So a router that applies a node's kv_events in order
// ends where the pool is: a key stored, evicted and stored again is
// BlockStored, BlockRemoved, BlockStored, whichever requests, engines and
// copy workers did each step.
//
// Under the lock a record costs two slice appends (its keys are kept back
// to back in one slice per drain);
// hex encoding, namespace lookup and publishing happen on the journal's
// goroutine. Consecutive records for one engine go out as one message
// (at most about kvMessageBytes, or the server's max_payload; a larger
// record is cut across messages),
// so a busy node publishes fewer,
// larger kv_events messages than one per change. Changes to keys of a
// namespace with no member are deferred (kvDeferred) and published on the
// next engine to join it, before anything else of the namespace.
type kvJournal struct {
	mu      sync.Mutex
	recs    []kvRecord
	keys    []messages.Key // the records' keys, back to back
	spare   []kvRecord
	spareK  []messages.Key
	closed  bool
	wake    chan struct{}
	closing chan struct{} // closed by close: a lingering drain goes at once
	done    chan struct{}
	started bool
	// emit publishes one kv_events body for engine, all of whose keys are
	// of namespaces of geometry (messages.HeaderGeometry); the body is
	// reused once it returns.
	emit func(engine string, geometry uint64, body []byte)
	// target says on which engine's kv_events keys of namespace ns are
	// announced ("": none), naming ns, ns's key (messages.NamespaceKey;
	// "": no such namespace) and its geometry fingerprint (see
	// Node.kvTarget).
	target func(engineID string, ns sched.NamespaceID) (name, nsKey, engine string, geometry uint64)
	// observe, when set, sees every run of keys of a namespace of this
	// boot, announced or not (the cluster's key set); set it before start.
	observe func(typ, medium, namespace string, keys []messages.Key)
	split   keySplit // run's scratch
	// deferred holds the changes of namespaces with no member until one
	// joins (the goroutine's own); onDefer, when set, counts the keys'
	// changes deferred and those dropped past its bound.
	deferred *kvDeferred
	onDefer  func(deferred, dropped int)
	scratch  []messages.Key // flushDeferred's
	// held lists the namespace ids held, in order (clearAll's: forgotten
	// ids leave holes): the node's table's (namespacesHeld); nil, none.
	held func() []sched.NamespaceID
	// bodyMax, when set, is the most bytes a kv_events body may hold on
	// the server the node is on now (read at each drain: a reconnect may
	// reach one with a smaller max_payload); it only lowers
	// kvMessageBytes.
	bodyMax func() int
	// linger is how long the goroutine waits, once woken, before it drains
	// (0: it drains at once). See Config.KVEventsLinger.
	linger time.Duration
}

// kvRecord is one change: keys[lo:hi] of its drain became loadable (typ
// BlockStored) or stopped being loadable (BlockRemoved) in medium, made by
// engine. A record of typ kvJoin has no keys: engine joined namespace ns;
// nor has one of typ kvClear: ns is cleared in medium.
type kvRecord struct {
	engine, typ, medium string
	lo, hi              int
	ns                  sched.NamespaceID
	gone                *namespace // a kvForget's: its table entry is gone
}

// kvJoin is the typ of a record of an engine joining a namespace (never
// on the wire).
const kvJoin = "join"

// kvResync is the typ of a record that clears what routers believe of
// every namespace (on the wire: an AllBlocksCleared per namespace and
// medium; see resync).
const kvResync = "resync"

// kvClear is the typ of a record that clears what routers believe of one
// namespace in one medium (on the wire: an AllBlocksCleared of it; see
// cleared).
const kvClear = "clear"

// kvForget is the typ of a record of namespace ns forgotten with engine,
// its owner (never on the wire as such): its deferred changes are dropped,
// no engine joins it again; on a cluster the other nodes are told the node
// holds none of its keys (see publish).
const kvForget = "forget"

// kvSpareKeys bounds the key buffer a journal keeps between drains.
const kvSpareKeys = 1 << 16

// kvMessageBytes bounds one message's JSON (about; the envelope adds a few
// dozen bytes): half of NATS' default 1 MiB max_payload, or less on a
// server whose max_payload is smaller (kvJournal.bodyMax), so a message is
// never refused whole for its size.
const kvMessageBytes = 512 << 10

func newKVJournal(emit func(string, uint64, []byte),
	target func(string, sched.NamespaceID) (string, string, string, uint64)) *kvJournal {
	return &kvJournal{wake: make(chan struct{}, 1), closing: make(chan struct{}), done: make(chan struct{}),
		emit: emit, target: target, deferred: newKVDeferred(kvDeferMost)}
}

// start runs the publishing goroutine; records added before it are kept.
func (j *kvJournal) start() {
	j.mu.Lock()
	defer j.mu.Unlock()
	if j.closed || j.started {
		return // closed first (a failed start): no goroutine to leak
	}
	j.started = true
	go j.run()
}

// pool is the pool's hostpool.Journal: medium CPU.
func (j *kvJournal) pool(stored bool, keys []messages.Key, engine string) {
	typ := messages.KVBlockRemoved
	if stored {
		typ = messages.KVBlockStored
	}
	j.add(engine, typ, messages.MediumCPU, keys)
}

// pending is how many records wait for the goroutine (a scrape's gauge).
func (j *kvJournal) pending() int {
	j.mu.Lock()
	defer j.mu.Unlock()
	return len(j.recs)
}

// add queues a record (its keys copied); nothing once closed.
func (j *kvJournal) add(engine, typ, medium string, keys []messages.Key) {
	if len(keys) == 0 {
		return
	}
	j.mu.Lock()
	if !j.closed {
		lo := len(j.keys)
		j.keys = append(j.keys, keys...)
		j.recs = append(j.recs, kvRecord{engine: engine, typ: typ, medium: medium, lo: lo, hi: len(j.keys)})
	}
	j.mu.Unlock()
	j.poke()
}

// joined queues engine's joining namespace ns, after which the namespace's
// deferred changes go out on its member (before anything else of it: a
// record drained after the join flushes them first too). Call it once
// engine is a member (namespaces.commit).
func (j *kvJournal) joined(engine string, ns sched.NamespaceID) {
	j.mu.Lock()
	if !j.closed {
		j.recs = append(j.recs, kvRecord{engine: engine, typ: kvJoin, ns: ns})
	}
	j.mu.Unlock()
	j.poke()
}

// resync queues a clear of every namespace of the boot, in both media:
// an AllBlocksCleared of each on its member, or, for a namespace with
// none, one owed to the next engine that joins it. The caller then
// re-announces what the pool and the disk hold (Node.reannounce), so a
// router ends believing what they hold whatever changes it missed.
func (j *kvJournal) resync() {
	j.mu.Lock()
	if !j.closed {
		j.recs = append(j.recs, kvRecord{typ: kvResync})
	}
	j.mu.Unlock()
	j.poke()
}

// cleared queues a clear of namespace ns in medium, announced as its
// changes are (on engine when a member, else on ns's member, or owed to
// its next one), after ns's changes queued before it. The caller then
// re-announces what ns holds in medium (see Node.register, the disk tier).
func (j *kvJournal) cleared(engine string, ns sched.NamespaceID, medium string) {
	j.mu.Lock()
	if !j.closed {
		j.recs = append(j.recs, kvRecord{engine: engine, typ: kvClear, medium: medium, ns: ns})
	}
	j.mu.Unlock()
	j.poke()
}

// forgot queues the forgetting of namespace ns, owned by engine: changes
// deferred for it are dropped once those queued before it are
// (Node.forgetNamespaces).
func (j *kvJournal) forgot(engine string, ns *namespace) {
	j.mu.Lock()
	if !j.closed {
		j.recs = append(j.recs, kvRecord{engine: engine, typ: kvForget, ns: ns.id, gone: ns})
	}
	j.mu.Unlock()
	j.poke()
}

// poke wakes the goroutine.
func (j *kvJournal) poke() {
	select {
	case j.wake <- struct{}{}:
	default:
	}
}

// close publishes what was added before it and stops the goroutine (a
// journal never started is only marked closed).
func (j *kvJournal) close() {
	j.mu.Lock()
	already, started := j.closed, j.started
	j.closed = true
	j.mu.Unlock()
	if already || !started {
		return
	}
	close(j.closing)
	select {
	case j.wake <- struct{}{}:
	default:
	}
	<-j.done
}

func (j *kvJournal) run() {
	defer close(j.done)
	var msg kvMessage
	var linger *time.Timer
	if j.linger > 0 {
		linger = time.NewTimer(j.linger)
		linger.Stop()
	}
	for range j.wake {
		if linger != nil {
			// Let the changes of the next moment join this drain: one wake-up
			// and one message per engine for all of them, not one each.
			// Closing does not wait for it.
			linger.Reset(j.linger)
			select {
			case <-linger.C:
			case <-j.closing:
				linger.Stop()
			}
		}
		j.mu.Lock()
		recs, keys, closed := j.recs, j.keys, j.closed
		j.recs, j.keys, j.spare, j.spareK = j.spare[:0], j.spareK[:0], nil, nil
		select {
		case <-j.wake: // for records this drain takes: no second linger for them
		default:
		}
		j.mu.Unlock()
		if j.bodyMax != nil {
			msg.max = min(kvMessageBytes, max(j.bodyMax(), 0))
		}
		for i := range recs {
			j.publish(&recs[i], keys[recs[i].lo:recs[i].hi], &msg)
		}
		msg.flush(j.emit)
		clear(keys)                  // the pool's strings: not ours to keep alive
		if cap(keys) > kvSpareKeys { // after a burst: let the collector have it
			recs, keys = nil, nil
		}
		j.mu.Lock()
		j.spare, j.spareK = recs[:0], keys[:0]
		more := len(j.recs) > 0
		j.mu.Unlock()
		if closed && !more {
			return
		}
	}
}

// publish turns one record into events on the engines of its keys'
// namespaces, appending to msg while the target engine stays the same.
// Changes to keys of a namespace with no member are deferred until an
// engine joins it, and then go out on its member before anything else of
// it.
func (j *kvJournal) publish(r *kvRecord, keys []messages.Key, msg *kvMessage) {
	switch r.typ {
	case kvJoin:
		if name, nsKey, engine, geo := j.target(r.engine, r.ns); nsKey != "" && engine != "" {
			j.flushDeferred(r.ns, engine, geo, name, msg)
		}
		return
	case kvResync:
		j.clearAll(msg)
		return
	case kvForget:
		j.deferred.take(r.ns)
		if j.observe != nil {
			// The cluster's key set drops its keys, and the other nodes,
			// told on its owner (whose namespace key it is), stop counting
			// them: the node serves none (cluster/holders). Its name, key
			// and geometry never change: read off the table.
			x := r.gone
			j.observe(messages.KVAllBlocksCleared, messages.MediumCPU, messages.ClusterNamespace(x.key, x.geo), nil)
			msg.addClear(r.engine, x.geo, messages.MediumCPU, x.name, j.emit)
		}
		return
	case kvClear:
		name, nsKey, engine, geo := j.target(r.engine, r.ns)
		switch {
		case nsKey == "":
		case engine == "":
			// No member to tell: the next one is told to forget the
			// namespace in both media (forgetting more is never wrong).
			j.deferred.clear(r.ns)
		default:
			j.flushDeferred(r.ns, engine, geo, name, msg)
			msg.addClear(engine, geo, r.medium, name, j.emit)
		}
		return
	}
	for run := range j.split.runs(keys) {
		name, nsKey, engine, geo := j.target(r.engine, run.ns)
		if nsKey == "" {
			continue // not a namespace of this boot
		}
		if j.observe != nil {
			// keyed as the cluster's holder index keys what it reads here:
			// a node of the cluster counts the key only for an engine of
			// the same geometry. Seen with no engine to tell too: the set
			// other nodes read back (keys) must still follow the pool.
			j.observe(r.typ, r.medium, messages.ClusterNamespace(nsKey, geo), run.keys)
		}
		if engine == "" {
			// No engine of that namespace is registered: no one to tell
			// now, the next one to join is.
			kept, dropped := j.deferred.add(run.ns, r.typ, r.medium, run.keys)
			if j.onDefer != nil {
				j.onDefer(kept, dropped)
			}
			continue
		}
		j.flushDeferred(run.ns, engine, geo, name, msg)
		msg.add(engine, geo, r.typ, run.group, r.medium, name, run.keys, j.emit)
	}
}

// clearAll appends an AllBlocksCleared of every namespace of the boot, in
// both media, on its member; a namespace with none has its deferred
// changes dropped and a clear owed to its next member. Deferred changes of
// a namespace with a member (its join not drained yet) are dropped too:
// the re-announcement that follows the clear supersedes them. A namespace
// forgotten since held listed it (nsKey "") is skipped.
func (j *kvJournal) clearAll(msg *kvMessage) {
	if j.held == nil {
		return
	}
	for _, ns := range j.held() {
		name, nsKey, engine, geo := j.target("", ns)
		if nsKey == "" {
			continue // forgotten meanwhile
		}
		if engine == "" {
			j.deferred.clear(ns)
			continue
		}
		j.deferred.take(ns)
		msg.addClear(engine, geo, messages.MediumCPU, name, j.emit)
		msg.addClear(engine, geo, messages.MediumDisk, name, j.emit)
	}
}

// flushDeferred appends namespace ns's deferred changes to msg for engine,
// its member: an AllBlocksCleared of ns first when some were dropped, then
// each run of changes of one type, medium and group as one event.
func (j *kvJournal) flushDeferred(ns sched.NamespaceID, engine string, geo uint64, name string, msg *kvMessage) {
	if !j.deferred.has(ns) {
		return
	}
	cleared, changes := j.deferred.take(ns)
	if cleared {
		// Both media: the clear covers the dropped changes of each, a DISK
		// write or deletion as much as a CPU store or eviction.
		msg.addClear(engine, geo, messages.MediumCPU, name, j.emit)
		msg.addClear(engine, geo, messages.MediumDisk, name, j.emit)
	}
	for len(changes) > 0 {
		c := changes[0]
		_, _, group := sched.SplitKey(c.key)
		keys := append(j.scratch[:0], c.key)
		n := 1
		for ; n < len(changes); n++ {
			_, _, g := sched.SplitKey(changes[n].key)
			if changes[n].typ != c.typ || changes[n].medium != c.medium || g != group {
				break
			}
			keys = append(keys, changes[n].key)
		}
		msg.add(engine, geo, c.typ, group, c.medium, name, keys, j.emit)
		clear(keys)
		j.scratch, changes = keys[:0], changes[n:]
	}
}

// keySplit groups a record's keys into runs of one (namespace, group),
// namespaces in first-seen order and each namespace's groups in
// first-seen order, so a record spanning namespaces (an eviction) makes
// one run of events per namespace. Its scratch is reused: not safe for
// concurrent use.
type keySplit struct {
	sets   []keySet
	sorted []messages.Key
}

// keySet is one run being counted, then filled: its namespace, group, and
// its keys' span of sorted (start, and next while filling).
type keySet struct {
	ns          sched.NamespaceID
	group       int
	count, next int
}

// keyRun is one (namespace, group) of a record's keys.
type keyRun struct {
	ns    sched.NamespaceID
	group int
	keys  []messages.Key
}

// runs yields keys' runs; each run's keys are the split's until the next
// call.
func (s *keySplit) runs(keys []messages.Key) iter.Seq[keyRun] {
	return func(yield func(keyRun) bool) {
		// A counting sort by (namespace, group). A record rarely spans more
		// than two sets, so they are searched linearly, and a namespace's
		// sets are kept next to each other as they are found.
		sets := s.sets[:0]
		for _, k := range keys {
			ns, _, g := sched.SplitKey(k)
			if i := findSet(sets, ns, g); i >= 0 {
				sets[i].count++
				continue
			}
			at := len(sets)
			for i := range sets {
				if sets[i].ns == ns {
					at = i + 1 // after the namespace's last set
				}
			}
			sets = slices.Insert(sets, at, keySet{ns: ns, group: g, count: 1})
		}
		pos := 0
		for i := range sets {
			sets[i].next, pos = pos, pos+sets[i].count
		}
		sorted := slices.Grow(s.sorted[:0], len(keys))[:len(keys)]
		for _, k := range keys {
			ns, _, g := sched.SplitKey(k)
			set := &sets[findSet(sets, ns, g)]
			sorted[set.next] = k
			set.next++
		}
		s.sets, s.sorted = sets, sorted
		defer func() {
			clear(sorted)                  // the pool's strings: not ours to keep alive
			if cap(sorted) > kvSpareKeys { // after a huge record: let the collector have them
				s.sorted = nil
			}
		}()
		for _, set := range sets { // set.next is now its end
			run := sorted[set.next-set.count : set.next : set.next]
			if !yield(keyRun{ns: set.ns, group: set.group, keys: run}) {
				return
			}
		}
	}
}

// findSet is the index of (ns, group) in sets, -1 if none.
func findSet(sets []keySet, ns sched.NamespaceID, group int) int {
	for i := range sets {
		if sets[i].ns == ns && sets[i].group == group {
			return i
		}
	}
	return -1
}

// kvTarget is where keys of namespace ns that engineID's operation
// changed are announced: on engineID when it is registered in ns, else on
// the member of ns registered last (namespace.announcer; no engine learns
// another namespace's hashes; none registered: engine "", the journal
// defers them until one joins).
// nsKey is "" when ns is no namespace of this boot (or one forgotten).
//
// It reads the namespace table only (its own RWMutex): n.mu is held by a
// register across its device attach, and the journal must not wait for it.
func (n *Node) kvTarget(engineID string, ns sched.NamespaceID) (name, nsKey, engine string, geo uint64) {
	t := &n.nss
	t.mu.RLock()
	defer t.mu.RUnlock()
	x := t.byID[ns]
	if x == nil { // none, or forgotten
		return "", "", "", 0
	}
	if t.member[engineID] == ns {
		return x.name, x.key, engineID, x.geo
	}
	return x.name, x.key, x.announcer(), x.geo
}

// reannounce has routers forget what they believe this node holds and
// tells them again, after a reconnect to NATS: kv_events published while
// the connection was down (past the client's reconnect buffer) or written
// into the connection that died are lost, and the node cannot tell which
// (PROTOCOL.md "kv_events"). The clear goes into the journal first, then
// the pool's keys and the disk tier's, each taken under its own lock, so
// every change they make meanwhile is in the journal's order around them.
func (n *Node) reannounce() {
	n.kv.resync()
	n.store.Reannounce()
	if n.disk != nil {
		n.disk.Reannounce()
	}
}

// publishKV is the journal's emit: one kv_events message, whose keys'
// namespaces have geometry geo (stamped on a cluster).
func (n *Node) publishKV(engine string, geo uint64, body []byte) {
	n.outbox.KVEventsBody(context.Background(), engine, geo, body)
}
