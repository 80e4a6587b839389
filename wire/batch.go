package wire

import (
	"encoding/hex"
	"strconv"

	"github.com/kvactors/kvactors/messages"
)

// Batch builds one P.E.events body, engine side (PROTOCOL.md "EventBatch"):
// events are appended as they are decided, the envelope is added by Body.
// The zero value is an empty batch; Reset reuses its buffer.
type Batch struct {
	buf    []byte
	events int
	inList bool // inside BeginHashes .. EndHashes; the next hash needs a comma
}

// Reset empties the batch, keeping its buffer.
func (b *Batch) Reset() { b.buf, b.events = b.buf[:0], 0 }

// Events is the number of events appended since Reset.
func (b *Batch) Events() int { return b.events }

// Len is the size in bytes of the events appended since Reset.
func (b *Batch) Len() int { return len(b.buf) }

// Added appends an added event.
func (b *Batch) Added(req string, promptTokens int) {
	b.open(messages.EvAdded, req)
	b.int("prompt_tokens", promptTokens)
	b.close()
}

// AddedMax appends an added event with max_offload_tokens (a bound on
// what kvactors offloads of the request).
func (b *Batch) AddedMax(req string, promptTokens, maxOffloadTokens int) {
	b.open(messages.EvAdded, req)
	b.int("prompt_tokens", promptTokens)
	b.int("max_offload_tokens", maxOffloadTokens)
	b.close()
}

// BeginHashes starts a hashes event; append each raw hash with Hash, then
// EndHashes. (An appender, not a slice argument, so callers with hashes in
// arrays or computed on the fly allocate nothing.)
func (b *Batch) BeginHashes(req string, start int) {
	b.open(messages.EvHashes, req)
	b.int("start", start)
	b.buf = append(b.buf, `,"hashes":[`...)
	b.inList = false
}

// Hash appends one raw hash, hex-encoded, to the open hashes event.
func (b *Batch) Hash(h []byte) {
	if b.inList {
		b.buf = append(b.buf, ',')
	}
	b.inList = true
	b.buf = append(b.buf, '"')
	b.buf = hex.AppendEncode(b.buf, h)
	b.buf = append(b.buf, '"')
}

// EndHashes closes the open hashes event.
func (b *Batch) EndHashes() {
	b.buf = append(b.buf, ']')
	b.close()
}

// Blocks appends a blocks event.
func (b *Batch) Blocks(req string, group, start int, ids []uint32) {
	b.open(messages.EvBlocks, req)
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

// Tokens appends a tokens event.
func (b *Batch) Tokens(req string, computed, total int) {
	b.open(messages.EvTokens, req)
	b.int("computed", computed)
	b.int("total", total)
	b.close()
}

// Preempted appends a preempted event.
func (b *Batch) Preempted(req string) { b.open(messages.EvPreempted, req); b.close() }

// Resumed appends a resumed event.
func (b *Batch) Resumed(req string) { b.open(messages.EvResumed, req); b.close() }

// Finished appends a finished event.
func (b *Batch) Finished(req string, aborted bool, computed, total int) {
	b.open(messages.EvFinished, req)
	b.buf = append(b.buf, `,"aborted":`...)
	b.buf = strconv.AppendBool(b.buf, aborted)
	b.int("computed", computed)
	b.int("total", total)
	b.close()
}

// Body appends the whole body, envelope and events, to dst[:0].
func (b *Batch) Body(dst []byte, epoch string, seq uint64) []byte {
	dst = append(dst[:0], `{"epoch":`...)
	dst = AppendString(dst, epoch)
	dst = append(dst, `,"seq":`...)
	dst = strconv.AppendUint(dst, seq, 10)
	dst = append(dst, `,"events":[`...)
	dst = append(dst, b.buf...)
	return append(dst, ']', '}')
}

func (b *Batch) open(typ messages.EventType, request string) {
	if b.events > 0 {
		b.buf = append(b.buf, ',')
	}
	b.events++
	b.buf = append(b.buf, `{"type":"`...)
	b.buf = append(b.buf, typ.String()...)
	b.buf = append(b.buf, `","request":`...)
	b.buf = AppendString(b.buf, request)
}

func (b *Batch) int(name string, v int) {
	b.buf = append(b.buf, ',', '"')
	b.buf = append(b.buf, name...)
	b.buf = append(b.buf, '"', ':')
	b.buf = strconv.AppendInt(b.buf, int64(v), 10)
}

func (b *Batch) close() { b.buf = append(b.buf, '}') }
