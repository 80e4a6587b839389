package node

import (
	"context"
	"sync"

	"github.com/kvactors/kvactors/actors"
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
// (at most about kvMessageBytes; a larger record is cut across messages),
// so a busy node publishes fewer,
// larger kv_events messages than one per change.
type kvJournal struct {
	mu      sync.Mutex
	recs    []kvRecord
	keys    []messages.Key // the records' keys, back to back
	spare   []kvRecord
	spareK  []messages.Key
	closed  bool
	wake    chan struct{}
	done    chan struct{}
	started bool
	ke      actors.KeyEvents // run's scratch
	// emit publishes one kv_events message for engine (the events are
	// reused once it returns).
	emit func(engine string, events []messages.KVEvent)
	// target says on which engine's kv_events keys of namespace ns are
	// announced, naming ns (see Node.kvTarget).
	target func(engineID string, ns sched.NamespaceID) (name, engine string)
}

// kvRecord is one change: keys[lo:hi] of its drain became loadable (typ
// BlockStored) or stopped being loadable (BlockRemoved) in medium, made by
// engine.
type kvRecord struct {
	engine, typ, medium string
	lo, hi              int
}

// kvSpareKeys bounds the key buffer a journal keeps between drains.
const kvSpareKeys = 1 << 16

// kvMessageBytes bounds one message's JSON (about; the envelope adds a few
// dozen bytes): half of NATS' default 1 MiB max_payload, which an external
// server may keep, so a message is never refused whole for its size.
const kvMessageBytes = 512 << 10

func newKVJournal(emit func(string, []messages.KVEvent),
	target func(string, sched.NamespaceID) (string, string)) *kvJournal {
	return &kvJournal{wake: make(chan struct{}, 1), done: make(chan struct{}), emit: emit, target: target}
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
	select {
	case j.wake <- struct{}{}:
	default:
	}
	<-j.done
}

func (j *kvJournal) run() {
	defer close(j.done)
	var msg kvMessage
	for range j.wake {
		j.mu.Lock()
		recs, keys, closed := j.recs, j.keys, j.closed
		j.recs, j.keys, j.spare, j.spareK = j.spare[:0], j.spareK[:0], nil, nil
		j.mu.Unlock()
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
func (j *kvJournal) publish(r *kvRecord, keys []messages.Key, msg *kvMessage) {
	j.ke.Group(keys, r.typ, r.medium, func(ns sched.NamespaceID, events []messages.KVEvent) {
		name, engine := j.target(r.engine, ns)
		if engine == "" {
			return // no engine of that namespace is registered: no one to tell
		}
		for i := range events {
			events[i].Namespace = name
		}
		msg.add(engine, events, j.emit)
	})
}

// kvMessage is the message being gathered: one engine's events in order,
// and about how many bytes they encode to.
type kvMessage struct {
	engine string
	events []messages.KVEvent
	bytes  int
}

// kvEventBytes is an upper bound of one event's JSON without its hashes
// (keys, type, medium, group, namespace, punctuation), and kvHashBytes of
// one hash's (quotes and comma).
func kvEventBytes(ev *messages.KVEvent) int {
	return 96 + len(ev.Type) + len(ev.Medium) + len(ev.Namespace)
}

func kvHashBytes(h string) int { return len(h) + 3 }

// add appends events for engine, flushing first when the engine changes
// and cutting an event's hashes wherever the message would pass
// kvMessageBytes (a long-context job stores thousands of chunks at once).
func (m *kvMessage) add(engine string, events []messages.KVEvent, emit func(string, []messages.KVEvent)) {
	if engine != m.engine {
		m.flush(emit)
		m.engine = engine
	}
	for i := range events {
		hashes := events[i].BlockHashes
		for len(hashes) > 0 {
			head := kvEventBytes(&events[i])
			if len(m.events) > 0 && m.bytes+head+kvHashBytes(hashes[0]) > kvMessageBytes {
				m.flush(emit)
			}
			n, size := 0, m.bytes+head
			for n < len(hashes) && (n == 0 || size+kvHashBytes(hashes[n]) <= kvMessageBytes) {
				size += kvHashBytes(hashes[n])
				n++
			}
			part := events[i]
			part.BlockHashes = hashes[:n:n]
			m.events = append(m.events, part)
			m.bytes = size
			hashes = hashes[n:]
		}
	}
}

func (m *kvMessage) flush(emit func(string, []messages.KVEvent)) {
	if len(m.events) > 0 {
		emit(m.engine, m.events)
	}
	clear(m.events)
	m.events, m.bytes = m.events[:0], 0
}

// kvTarget is where keys of namespace ns that engineID's operation
// changed are announced: on engineID when it is registered in ns, else on
// the engine last registered in ns (no engine learns another namespace's
// hashes; none registered: not announced).
//
// It reads the namespace table only (its own RWMutex): n.mu is held by a
// register across its device attach, and the journal must not wait for it.
func (n *Node) kvTarget(engineID string, ns sched.NamespaceID) (name, engine string) {
	t := &n.nss
	t.mu.RLock()
	defer t.mu.RUnlock()
	if ns == 0 || int(ns) > len(t.byID) {
		return "", ""
	}
	x := t.byID[ns-1]
	if t.member[engineID] == ns {
		return x.name, engineID
	}
	return x.name, x.engine
}

// publishKV is the journal's emit: one kv_events message.
func (n *Node) publishKV(engine string, events []messages.KVEvent) {
	n.outbox.KVEvents(context.Background(), engine, events)
}
