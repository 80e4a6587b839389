package sim

import (
	"encoding/hex"
	"encoding/json"
	"strconv"
)

// batch builds one P.E.events body (PROTOCOL.md "EventBatch") by appending
// JSON directly: a step's batch can hold hundreds of events and the engine
// side should cost the node's benchmarks as little as a real engine's
// msgspec encoder does.
type batch struct {
	buf    []byte
	events int
}

func (b *batch) reset() {
	b.buf = b.buf[:0]
	b.events = 0
}

// open starts the next event object.
func (b *batch) open(typ, request string) {
	if b.events > 0 {
		b.buf = append(b.buf, ',')
	}
	b.events++
	b.buf = append(b.buf, `{"type":"`...)
	b.buf = append(b.buf, typ...)
	b.buf = append(b.buf, `","request":`...)
	b.buf = appendString(b.buf, request)
}

func (b *batch) int(name string, v int) {
	b.buf = append(b.buf, ',', '"')
	b.buf = append(b.buf, name...)
	b.buf = append(b.buf, '"', ':')
	b.buf = strconv.AppendInt(b.buf, int64(v), 10)
}

func (b *batch) close() { b.buf = append(b.buf, '}') }

func (b *batch) added(req string, prompt int) {
	b.open("added", req)
	b.int("prompt_tokens", prompt)
	b.close()
}

func (b *batch) hashes(req string, start int, hs []Hash) {
	b.open("hashes", req)
	b.int("start", start)
	b.buf = append(b.buf, `,"hashes":[`...)
	for i := range hs {
		if i > 0 {
			b.buf = append(b.buf, ',')
		}
		b.buf = append(b.buf, '"')
		b.buf = hex.AppendEncode(b.buf, hs[i][:])
		b.buf = append(b.buf, '"')
	}
	b.buf = append(b.buf, ']')
	b.close()
}

func (b *batch) blocks(req string, group, start int, ids []uint32) {
	b.open("blocks", req)
	b.int("group", group)
	b.int("start", start)
	b.buf = append(b.buf, `,"ids":[`...)
	for i, id := range ids {
		if i > 0 {
			b.buf = append(b.buf, ',')
		}
		b.buf = strconv.AppendUint(b.buf, uint64(id), 10)
	}
	b.buf = append(b.buf, ']')
	b.close()
}

func (b *batch) tokens(req string, computed, total int) {
	b.open("tokens", req)
	b.int("computed", computed)
	b.int("total", total)
	b.close()
}

func (b *batch) lifecycle(typ, req string) {
	b.open(typ, req)
	b.close()
}

func (b *batch) finished(req string, aborted bool, computed, total int) {
	b.open("finished", req)
	b.buf = append(b.buf, `,"aborted":`...)
	b.buf = strconv.AppendBool(b.buf, aborted)
	b.int("computed", computed)
	b.int("total", total)
	b.close()
}

// body wraps the events in the envelope.
func (b *batch) body(dst []byte, epoch string, seq uint64) []byte {
	dst = append(dst[:0], `{"epoch":`...)
	dst = appendString(dst, epoch)
	dst = append(dst, `,"seq":`...)
	dst = strconv.AppendUint(dst, seq, 10)
	dst = append(dst, `,"events":[`...)
	dst = append(dst, b.buf...)
	return append(dst, ']', '}')
}

// appendString appends s as a JSON string: plain ASCII directly, anything
// else through encoding/json so escaping is always right.
func appendString(dst []byte, s string) []byte {
	for i := 0; i < len(s); i++ {
		if c := s[i]; c < 0x20 || c >= 0x7f || c == '"' || c == '\\' {
			q, _ := json.Marshal(s) // a string always marshals
			return append(dst, q...)
		}
	}
	dst = append(dst, '"')
	dst = append(dst, s...)
	return append(dst, '"')
}
