package wire

import (
	"encoding/json"
	"math"
	"slices"
	"strconv"
	"unicode/utf8"

	"github.com/kvactors/kvactors/messages"
)

// AppendReleased appends a P.E.released body.
func AppendReleased(b []byte, r *messages.Released) []byte {
	b = append(b, `{"request":`...)
	b = AppendString(b, r.Request)
	b = append(b, `,"epoch":`...)
	b = AppendString(b, r.Epoch)
	b = append(b, `,"rseq":`...)
	b = strconv.AppendUint(b, r.RSeq, 10)
	b = append(b, `,"reason":`...)
	b = AppendString(b, r.Reason)
	return append(b, '}')
}

// AppendStored appends a P.E.stored body. It is the pieces below put
// together, the reference the tests hold them to; a request actor uses the
// pieces to write its message in place, hex-encoding each chunk's key
// straight from the pool key.
func AppendStored(b []byte, s *messages.Stored) []byte {
	n := 64 + len(s.Request)
	for _, c := range s.Chunks {
		n += 40 + len(c.Key)
	}
	b = slices.Grow(b, n) // one allocation, not a growth per chunk
	if s.Chunks == nil {
		b = append(b, `{"request":`...)
		b = AppendString(b, s.Request)
		b = append(b, `,"job":`...)
		b = strconv.AppendUint(b, s.Job, 10)
		b = append(b, `,"chunks":null`...)
		return appendStoredTail(b, s.Bytes)
	}
	b = AppendStoredOpen(b, s.Request, s.Job)
	for i, c := range s.Chunks {
		if i > 0 {
			b = append(b, ',')
		}
		b = appendStoredChunkHead(b, c.Group, c.Index)
		b = AppendString(b, c.Key)
		b = append(b, '}')
	}
	return AppendStoredClose(b, s.Bytes)
}

// AppendStoredOpen starts a stored body, up to its first chunk:
// `{"request":R,"job":J,"chunks":[`.
func AppendStoredOpen(b []byte, request string, job uint64) []byte {
	b = append(b, `{"request":`...)
	b = AppendString(b, request)
	b = append(b, `,"job":`...)
	b = strconv.AppendUint(b, job, 10)
	return append(b, `,"chunks":[`...)
}

// AppendStoredChunkHex appends one chunk, its key given raw and written as
// hex: `{"group":G,"index":I,"key":"HEX"}`.
func AppendStoredChunkHex(b []byte, group, index int, rawKey string) []byte {
	b = appendStoredChunkHead(b, group, index)
	return append(AppendHexString(b, rawKey), '}')
}

func appendStoredChunkHead(b []byte, group, index int) []byte {
	b = append(b, `{"group":`...)
	b = strconv.AppendInt(b, int64(group), 10)
	b = append(b, `,"index":`...)
	b = strconv.AppendInt(b, int64(index), 10)
	return append(b, `,"key":`...)
}

// AppendStoredClose ends a body AppendStoredOpen started: `],"bytes":N}`.
func AppendStoredClose(b []byte, bytes int64) []byte {
	return appendStoredTail(append(b, ']'), bytes)
}

func appendStoredTail(b []byte, bytes int64) []byte {
	b = append(b, `,"bytes":`...)
	b = strconv.AppendInt(b, bytes, 10)
	return append(b, '}')
}

// AppendKVEvents appends a P.E.kv_events body. It is the pieces below put
// together, the reference the tests hold them to; the node's journal uses
// the pieces to write its messages in place, hex-encoding each hash
// straight from the pool key.
func AppendKVEvents(b []byte, batch *messages.KVEventBatch) []byte {
	n := 32
	for _, ev := range batch.Events {
		n += 64 + len(ev.Type) + len(ev.Medium) + len(ev.Namespace)
		for _, h := range ev.BlockHashes {
			n += 3 + len(h)
		}
	}
	b = slices.Grow(b, n) // one allocation, not a growth per hash
	if batch.Events == nil {
		b = append(b, `{"ts":`...)
		b = appendFloat(b, batch.TS)
		return append(b, `,"events":null}`...)
	}
	b = AppendKVBatchOpen(b, batch.TS)
	for i, ev := range batch.Events {
		if i > 0 {
			b = append(b, ',')
		}
		if ev.BlockHashes == nil {
			b = append(b, `{"type":`...)
			b = AppendString(b, ev.Type)
			b = append(b, `,"block_hashes":null`...)
			b = appendKVEventTail(b, ev.GroupIdx, ev.Medium, ev.Namespace)
			continue
		}
		b = AppendKVEventOpen(b, ev.Type)
		for j, h := range ev.BlockHashes {
			if j > 0 {
				b = append(b, ',')
			}
			b = AppendString(b, h)
		}
		b = AppendKVEventClose(b, ev.GroupIdx, ev.Medium, ev.Namespace)
	}
	return AppendKVBatchClose(b)
}

// AppendKVBatchOpen starts a kv_events body: `{"ts":TS,"events":[`.
func AppendKVBatchOpen(b []byte, ts float64) []byte {
	b = append(b, `{"ts":`...)
	b = appendFloat(b, ts)
	return append(b, `,"events":[`...)
}

// AppendKVBatchClose ends a body AppendKVBatchOpen started.
func AppendKVBatchClose(b []byte) []byte { return append(b, "]}"...) }

// AppendKVEventOpen starts one event, up to its first hash:
// `{"type":TYPE,"block_hashes":[`.
func AppendKVEventOpen(b []byte, typ string) []byte {
	b = append(b, `{"type":`...)
	b = AppendString(b, typ)
	return append(b, `,"block_hashes":[`...)
}

// AppendHexString appends raw hex-encoded as a JSON string (hex needs no
// escaping): a block hash as kv_events show it.
func AppendHexString(b []byte, raw string) []byte {
	b = append(b, '"')
	b = AppendHex(b, raw)
	return append(b, '"')
}

// AppendKVEventClose ends an event after its hashes:
// `],"group_idx":G,"medium":M,"namespace":NS}` (namespace omitted when
// empty, as encoding/json's omitempty does).
func AppendKVEventClose(b []byte, group int, medium, namespace string) []byte {
	return appendKVEventTail(append(b, ']'), group, medium, namespace)
}

func appendKVEventTail(b []byte, group int, medium, namespace string) []byte {
	b = append(b, `,"group_idx":`...)
	b = strconv.AppendInt(b, int64(group), 10)
	b = append(b, `,"medium":`...)
	b = AppendString(b, medium)
	if namespace != "" {
		b = append(b, `,"namespace":`...)
		b = AppendString(b, namespace)
	}
	return append(b, '}')
}

// AppendString writes s as a JSON string. Plain printable ASCII without
// quotes or backslashes (every hex key, reason and most request ids) is
// copied; anything else goes through encoding/json, so escaping is never
// ours to get wrong.
func AppendString(b []byte, s string) []byte {
	for i := 0; i < len(s); i++ {
		if !plain[s[i]] {
			q, _ := json.Marshal(s)
			return append(b, q...)
		}
	}
	b = append(b, '"')
	b = append(b, s...)
	return append(b, '"')
}

// AppendHex appends s's bytes as lowercase hex (encoding/hex's digits),
// without converting s to a []byte first.
func AppendHex(b []byte, s string) []byte {
	const digits = "0123456789abcdef"
	for i := 0; i < len(s); i++ {
		b = append(b, digits[s[i]>>4], digits[s[i]&0x0f])
	}
	return b
}

// plain marks the bytes AppendString copies as they are: printable ASCII
// but quotes, backslashes and the characters encoding/json escapes for HTML.
// One table load per byte instead of seven comparisons: every hex key of
// every stored and kv_events body goes through here.
var plain = func() (t [256]bool) {
	for c := 0x20; c < utf8.RuneSelf; c++ {
		t[c] = c != '"' && c != '\\' && c != '<' && c != '>' && c != '&'
	}
	return t
}()

// appendFloat formats like encoding/json does for float64: plain decimal in
// [1e-6, 1e21) (every timestamp), encoding/json itself elsewhere.
func appendFloat(b []byte, f float64) []byte {
	if a := math.Abs(f); a == 0 || (a >= 1e-6 && a < 1e21) {
		return strconv.AppendFloat(b, f, 'f', -1, 64)
	}
	q, err := json.Marshal(f)
	if err != nil { // NaN or Inf: not a timestamp we make
		return append(b, '0')
	}
	return append(b, q...)
}
