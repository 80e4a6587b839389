package ingest

import (
	"bytes"
	"encoding/json"
	"errors"
	"fmt"
	"math"
	"strings"
	"unicode/utf8"

	"github.com/kvactors/kvactors/messages"
)

// cudaIPCHandleBytes is sizeof(cudaIpcMemHandle_t).
const cudaIPCHandleBytes = 64

// maxShmNameBytes is NAME_MAX on Linux: a shm name is one file name.
const maxShmNameBytes = 255

// MaxNamespaceBytes bounds EngineSpec "namespace" (PROTOCOL.md "Isolation").
const MaxNamespaceBytes = 128

// DecodeSpec decodes the body of P.E.register and checks its structure
// (PROTOCOL.md "EngineSpec"). It does not check that regions lie inside
// their segments: that needs the segment sizes, which only the backend that
// opens them knows. Errors wrap ErrBadSpec (and ErrMalformed for invalid
// JSON) and name the offending field, e.g. "groups[1].regions[0].block_stride".
func DecodeSpec(data []byte, lim Limits) (messages.EngineSpec, error) {
	lim = lim.WithDefaults()
	var s messages.EngineSpec
	if err := decodeJSON(data, &s); err != nil {
		return messages.EngineSpec{}, fmt.Errorf("%w: %w", ErrBadSpec, err)
	}
	if ns := rawMember(data, func(r *rawMembers) json.RawMessage { return r.Namespace }); loneSurrogate(ns) {
		return messages.EngineSpec{}, specErr("namespace is not valid UTF-8 (a lone surrogate escape)")
	}
	if err := checkSpec(&s, lim); err != nil {
		return messages.EngineSpec{}, err
	}
	return s, nil
}

// decodeJSON is the encoding/json path for the bodies that are not hot
// (register, lookup, load). The body must be UTF-8 (RFC 8259), checked
// first because encoding/json would silently replace bad bytes.
func decodeJSON(data []byte, v any) error {
	if !utf8.Valid(data) {
		return fmt.Errorf("%w: body is not valid UTF-8", ErrMalformed)
	}
	if t := bytes.TrimLeft(data, " \t\r\n"); len(t) == 0 || t[0] != '{' {
		return fmt.Errorf("%w: body is not a JSON object", ErrMalformed)
	}
	if err := json.Unmarshal(data, v); err != nil {
		var te *json.UnmarshalTypeError
		if errors.As(err, &te) {
			return fmt.Errorf("%w: %q is a JSON %s, want %s", ErrMalformed, te.Field, te.Value, te.Type)
		}
		return fmt.Errorf("%w: %w", ErrMalformed, err)
	}
	return nil
}

// rawMembers are the members whose JSON strings must not hold a lone
// surrogate escape, as encoding/json reads them (the same key matching as
// the decode proper), kept raw.
type rawMembers struct {
	Request   json.RawMessage `json:"request"`
	Epoch     json.RawMessage `json:"epoch"`
	Namespace json.RawMessage `json:"namespace"`
}

// rawMember is pick's member of data (a body decodeJSON accepted) as it
// was sent, or nil. Only a body with a \u escape is read again: the others
// cannot hold a lone surrogate.
func rawMember(data []byte, pick func(*rawMembers) json.RawMessage) json.RawMessage {
	if !bytes.Contains(data, []byte(`\u`)) {
		return nil
	}
	var r rawMembers
	if json.Unmarshal(data, &r) != nil {
		return nil
	}
	return pick(&r)
}

// loneSurrogate reports whether raw, a JSON string, holds an escape of a
// lone surrogate (\ud800), which encoding/json silently replaces by U+FFFD:
// two distinct ids would collapse into one, so the encoding/json decoders
// refuse it as DecodeBatch does (doc.go; docs/PROTOCOL.md "A lone
// surrogate escape in a request id is rejected, never replaced").
func loneSurrogate(raw json.RawMessage) bool {
	l := lexer{data: raw}
	if l.peek() != '"' {
		return false
	}
	s, esc, err := l.str()
	if err != nil || !esc {
		return false
	}
	_, valid := l.unescape(s)
	return !valid
}

// SpecError is a spec refusal found outside this package (it wraps
// ErrBadSpec, so it counts as bad_spec).
func SpecError(format string, args ...any) error { return specErr(format, args...) }

func specErr(format string, args ...any) error {
	return fmt.Errorf("%w: %s", ErrBadSpec, fmt.Sprintf(format, args...))
}

func checkSpec(s *messages.EngineSpec, lim Limits) error {
	switch {
	case s.TokensPerHash < 1:
		return specErr("tokens_per_hash = %d, want >= 1", s.TokensPerHash)
	case s.BlocksPerChunk < 1:
		return specErr("blocks_per_chunk = %d, want >= 1", s.BlocksPerChunk)
	case s.NumGPUBlocks < 1 || int64(s.NumGPUBlocks) > MaxGPUBlocks:
		return specErr("num_gpu_blocks = %d, want 1..2^31", s.NumGPUBlocks)
	case len(s.Segments) < 1 || len(s.Segments) > lim.MaxSegments:
		return specErr("%d segments, want 1..%d", len(s.Segments), lim.MaxSegments)
	case len(s.Groups) < 1 || len(s.Groups) > lim.MaxGroups:
		return specErr("%d groups, want 1..%d", len(s.Groups), lim.MaxGroups)
	case len(s.Namespace) > MaxNamespaceBytes:
		return specErr("namespace is %d bytes, want 1..%d (or absent: the engine id)", len(s.Namespace), MaxNamespaceBytes)
	case len(s.Node) > MaxEngineIDBytes:
		// Not quoted: a node's logs and replies carry the name.
		return specErr("node is %d bytes, want a node id: [A-Za-z0-9_-]{1,%d}, not starting with _ (or absent)", len(s.Node), MaxEngineIDBytes)
	case s.Node != "" && !ValidEngineID(s.Node):
		return specErr("node %q is not a node id: want [A-Za-z0-9_-]{1,%d}, not starting with _ (or absent)", s.Node, MaxEngineIDBytes)
	case s.MaxModelLen < 0:
		return specErr("max_model_len = %d, want >= 0 (0: num_gpu_blocks * the largest tokens_per_block)", s.MaxModelLen)
	}
	for i := range s.Segments {
		if err := checkSegment(&s.Segments[i]); err != nil {
			return fmt.Errorf("segments[%d]: %w", i, err)
		}
	}
	for g := range s.Groups {
		if err := checkGroup(s, &s.Groups[g], lim); err != nil {
			return fmt.Errorf("groups[%d]: %w", g, err)
		}
	}
	return nil
}

// CheckOwner applies the rules of PROTOCOL.md "Isolation" that need the
// engine id, before anything is opened: every shm segment is named after
// the engine (its id followed by '-' or '.': engine e1 may name e1-kv or
// e1.kv, never e2-kv). The rest of the ownership rule (a regular file with
// one link, inside the shm directory) is the shm backend's, at attach.
func CheckOwner(engine string, s *messages.EngineSpec) error {
	for i, seg := range s.Segments {
		if seg.Shm == "" {
			continue
		}
		rest, ok := strings.CutPrefix(seg.Shm, engine)
		if !ok || rest == "" || (rest[0] != '-' && rest[0] != '.') {
			return fmt.Errorf("segments[%d]: %w", i,
				specErr("shm %q is not engine %q's: its name must start with %q or %q", seg.Shm, engine, engine+"-", engine+"."))
		}
	}
	return nil
}

// Namespace is the spec's namespace as the engine names it: its
// "namespace", or the engine id (what kv_events announce); its identity
// is messages.NamespaceKey.
func Namespace(engine string, s *messages.EngineSpec) string {
	if s.Namespace != "" {
		return s.Namespace
	}
	return engine
}

func checkSegment(seg *messages.Segment) error {
	switch {
	case seg.Shm != "" && seg.CUDAIPC != "":
		return specErr(`both "shm" and "cuda_ipc" are set, want exactly one`)
	case seg.Shm != "":
		// The name becomes a path under the shm directory: one plain file
		// name, so it cannot walk out of that directory.
		n := seg.Shm
		if len(n) > maxShmNameBytes || n == "." || n == ".." || strings.ContainsAny(n, "/\x00") {
			return specErr("shm %q is not a plain file name (no '/', not '.' or '..', at most %d bytes)", n, maxShmNameBytes)
		}
		return nil
	case seg.CUDAIPC != "":
		if len(seg.CUDAIPC) != 2*cudaIPCHandleBytes {
			return specErr("cuda_ipc is %d hex digits, want %d (a cudaIpcMemHandle_t)", len(seg.CUDAIPC), 2*cudaIPCHandleBytes)
		}
		if _, ok := appendHash(nil, seg.CUDAIPC, cudaIPCHandleBytes); !ok {
			return specErr("cuda_ipc is not lowercase hex")
		}
		if seg.Bytes <= 0 {
			return specErr("cuda_ipc segment bytes = %d, want > 0", seg.Bytes)
		}
		if seg.Device < 0 {
			return specErr("device = %d, want >= 0", seg.Device)
		}
		return nil
	}
	return specErr(`neither "shm" nor "cuda_ipc" is set, want exactly one`)
}

func checkGroup(s *messages.EngineSpec, g *messages.GroupSpec, lim Limits) error {
	switch g.Kind {
	case messages.KindFull, messages.KindEagle:
	case messages.KindSlidingWindow:
		if g.SlidingWindow < 1 {
			return specErr("sliding_window = %d, want >= 1 for kind %q", g.SlidingWindow, g.Kind)
		}
	default:
		return specErr("kind %q, want %q, %q or %q", g.Kind, messages.KindFull, messages.KindSlidingWindow, messages.KindEagle)
	}
	if g.TokensPerBlock < 1 {
		return specErr("tokens_per_block = %d, want >= 1", g.TokensPerBlock)
	}
	if g.TokensPerBlock > math.MaxInt32/s.BlocksPerChunk {
		return specErr("tokens_per_block * blocks_per_chunk = %d * %d is too large", g.TokensPerBlock, s.BlocksPerChunk)
	}
	if tpc := g.TokensPerBlock * s.BlocksPerChunk; tpc%s.TokensPerHash != 0 {
		return specErr("tokens per chunk %d (tokens_per_block %d * blocks_per_chunk %d) is not a multiple of tokens_per_hash %d",
			tpc, g.TokensPerBlock, s.BlocksPerChunk, s.TokensPerHash)
	}
	if len(g.Regions) < 1 || len(g.Regions) > lim.MaxRegions {
		return specErr("%d regions, want 1..%d", len(g.Regions), lim.MaxRegions)
	}
	for i := range g.Regions {
		if err := checkRegion(s, &g.Regions[i]); err != nil {
			return fmt.Errorf("regions[%d]: %w", i, err)
		}
	}
	return nil
}

func checkRegion(s *messages.EngineSpec, r *messages.Region) error {
	switch {
	case r.Segment < 0 || r.Segment >= len(s.Segments):
		return specErr("segment = %d, want 0..%d", r.Segment, len(s.Segments)-1)
	case r.Offset < 0:
		return specErr("offset = %d, want >= 0", r.Offset)
	case r.BlockBytes < 1:
		return specErr("block_bytes = %d, want >= 1", r.BlockBytes)
	case r.BlockStride < r.BlockBytes:
		return specErr("block_stride = %d, want >= block_bytes (%d)", r.BlockStride, r.BlockBytes)
	}
	// The region's end, offset + (num_gpu_blocks-1)*stride + bytes, must fit
	// in int64, so that the later inside-the-segment check cannot overflow.
	last := int64(s.NumGPUBlocks - 1)
	if last > 0 && r.BlockStride > (math.MaxInt64-r.Offset-r.BlockBytes)/last {
		return specErr("offset %d + %d blocks * block_stride %d overflows", r.Offset, s.NumGPUBlocks, r.BlockStride)
	}
	if r.Offset > math.MaxInt64-r.BlockBytes {
		return specErr("offset %d + block_bytes %d overflows", r.Offset, r.BlockBytes)
	}
	return nil
}
