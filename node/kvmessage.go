package node

import (
	"time"

	"github.com/kvactors/kvactors/messages"
	"github.com/kvactors/kvactors/sched"
	"github.com/kvactors/kvactors/wire"
)

// kvMessage is the message being written: one engine's kv_events body,
// of keys of one geometry (the message's messages.HeaderGeometry), built
// in place (each hash hex-encoded from the pool key straight into it) and
// cut before it would pass its limit.
type kvMessage struct {
	engine string
	geo    uint64           // the geometry of the namespaces of its keys
	body   []byte           // the batch opened, events so far; empty: none
	tail   []byte           // the current event's closing, known before its hashes
	now    func() time.Time // the batch's ts; nil: time.Now (a test fixes it to cut exactly)
	// max bounds the body: kvMessageBytes, or less on a server whose
	// max_payload is smaller (kvJournal.bodyMax); 0: kvMessageBytes.
	max int
}

// limit is the most bytes the body may hold.
func (m *kvMessage) limit() int {
	if m.max > 0 {
		return m.max
	}
	return kvMessageBytes
}

// add appends one event of keys (one namespace, of geometry geo, one
// group) for engine, flushing first when the engine or the geometry
// changes, and cutting the event across messages wherever the body would
// pass its limit (a long-context job stores thousands of chunks at
// once).
func (m *kvMessage) add(engine string, geo uint64, typ string, group int, medium, namespace string, keys []messages.Key,
	emit func(string, uint64, []byte)) {
	if engine != m.engine || geo != m.geo {
		m.flush(emit)
		m.engine, m.geo = engine, geo
	}
	m.tail = wire.AppendKVEventClose(m.tail[:0], group, medium, namespace)
	// An event's comma and head; its first hash has no comma of its own.
	headBytes := len(`,{"type":"","block_hashes":[`) + len(typ) - 1
	end := len(m.tail) + len("]}") // what must still fit after a hash
	limit := m.limit()
	for len(keys) > 0 {
		_, h, _ := sched.SplitKey(keys[0])
		if len(m.body) > 0 && len(m.body)+headBytes+hexBytes(h)+end > limit {
			m.flush(emit)
		}
		m.next()
		m.body = wire.AppendHexString(wire.AppendKVEventOpen(m.body, typ), string(h))
		n := 1
		for ; n < len(keys); n++ {
			_, h, _ := sched.SplitKey(keys[n])
			if len(m.body)+hexBytes(h)+end > limit {
				break
			}
			m.body = wire.AppendHexString(append(m.body, ','), string(h))
		}
		m.body = append(m.body, m.tail...)
		if keys = keys[n:]; len(keys) > 0 {
			m.flush(emit)
		}
	}
}

// addClear appends an AllBlocksCleared of namespace in medium for engine:
// a router forgets what it believes of that namespace in that medium on
// this node (PROTOCOL.md "kv_events", deferred changes past the bound).
func (m *kvMessage) addClear(engine string, geo uint64, medium, namespace string, emit func(string, uint64, []byte)) {
	if engine != m.engine || geo != m.geo {
		m.flush(emit)
		m.engine, m.geo = engine, geo
	}
	m.tail = append(m.tail[:0], `{"type":`...)
	m.tail = wire.AppendString(m.tail, messages.KVAllBlocksCleared)
	m.tail = append(m.tail, `,"medium":`...)
	m.tail = wire.AppendString(m.tail, medium)
	m.tail = append(m.tail, `,"namespace":`...)
	m.tail = append(wire.AppendString(m.tail, namespace), '}')
	if len(m.body) > 0 && len(m.body)+1+len(m.tail)+len("]}") > m.limit() {
		m.flush(emit)
	}
	m.next()
	m.body = append(m.body, m.tail...)
}

// next opens the body for an event: the batch's head when it is empty,
// else the comma after the last event.
func (m *kvMessage) next() {
	if len(m.body) > 0 {
		m.body = append(m.body, ',')
		return
	}
	now := time.Now
	if m.now != nil {
		now = m.now
	}
	m.body = wire.AppendKVBatchOpen(m.body, float64(now().UnixNano())/1e9)
}

// hexBytes is what a hash adds to a body: its hex, quotes and comma.
func hexBytes(h messages.Hash) int { return 2*len(h) + 3 }

func (m *kvMessage) flush(emit func(string, uint64, []byte)) {
	if len(m.body) > 0 {
		emit(m.engine, m.geo, wire.AppendKVBatchClose(m.body))
	}
	m.body = m.body[:0]
	if cap(m.body) > 2*kvMessageBytes {
		m.body = nil
	}
}
