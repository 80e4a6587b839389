package wire

import (
	"encoding/json"
	"math"
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

// A P.E.stored body is written in pieces, so that a request actor
// hex-encodes each chunk's key straight from the pool key into the body:
// AppendStoredOpen, AppendStoredChunkHex per chunk (comma-separated), then
// AppendStoredClose. Together they make encoding/json's bytes for a
// messages.Stored with hex keys.

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
	b = append(b, `{"group":`...)
	b = strconv.AppendInt(b, int64(group), 10)
	b = append(b, `,"index":`...)
	b = strconv.AppendInt(b, int64(index), 10)
	b = append(b, `,"key":`...)
	return append(AppendHexString(b, rawKey), '}')
}

// AppendStoredClose ends a body AppendStoredOpen started: `],"bytes":N}`.
func AppendStoredClose(b []byte, bytes int64) []byte {
	b = append(b, `],"bytes":`...)
	b = strconv.AppendInt(b, bytes, 10)
	return append(b, '}')
}

// A P.E.kv_events body is written in pieces too, by the node's journal,
// each hash hex-encoded from the pool key: AppendKVBatchOpen, then per
// event (comma-separated) AppendKVEventOpen, its hashes by AppendHexString
// (comma-separated) and AppendKVEventClose, then AppendKVBatchClose.

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
	b = append(b, `],"group_idx":`...)
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
