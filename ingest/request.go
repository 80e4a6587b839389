package ingest

import (
	"encoding/json"
	"fmt"
	"math"
	"unicode/utf8"

	"github.com/kvactors/kvactors/messages"
)

// Load is a checked P.E.load body.
type Load struct {
	// Request is the engine's request id that the blocks belong to.
	Request string
	// Hashes are the request's block hashes, as raw bytes.
	Hashes []messages.Hash
	// NumTokens is how many leading tokens to load (>= 0).
	NumTokens int
	// Blocks[g] are the GPU block ids of group g to load into, bpc per
	// chunk, in order; id 0 means "not needed".
	Blocks [][]messages.BlockID
}

// DecodeLookup decodes the body of P.E.lookup, {"hashes":[...]}, into raw
// hashes. An absent or empty list is a valid lookup (it hits 0 tokens).
// Errors wrap ErrMalformed.
func DecodeLookup(data []byte, lim Limits) ([]messages.Hash, error) {
	lim = lim.WithDefaults()
	var req messages.LookupRequest
	if err := decodeJSON(data, &req); err != nil {
		return nil, fmt.Errorf("lookup: %w", err)
	}
	hs, err := decodeHashes(req.Hashes, lim)
	if err != nil {
		return nil, fmt.Errorf("lookup: %w", err)
	}
	return hs, nil
}

// DecodeHeartbeat decodes and checks the body of P.E.heartbeat,
// {"epoch","seq"}: a JSON object whose epoch and seq are what a batch's may
// be (a non-empty UTF-8 string of at most MaxEpochBytes; an integer in
// [0, 2^63)), so a heartbeat cannot begin an epoch no batch could continue,
// nor claim a tail of batches no batch could carry (a resync of the live
// epoch, or a reset by one it begins). Errors wrap ErrMalformed.
func DecodeHeartbeat(data []byte) (messages.HeartbeatRequest, error) {
	var body struct {
		Epoch string  `json:"epoch"`
		Seq   *uint64 `json:"seq"` // nil: absent or null, which a batch's seq cannot be
	}
	if err := decodeJSON(data, &body); err != nil {
		return messages.HeartbeatRequest{}, fmt.Errorf("heartbeat: %w", err)
	}
	req := messages.HeartbeatRequest{Epoch: body.Epoch}
	if body.Seq != nil {
		req.Seq = *body.Seq
	}
	switch {
	case body.Seq == nil:
		return req, fmt.Errorf("heartbeat: %w: \"seq\" is missing or null", ErrMalformed)
	case req.Epoch == "":
		return req, fmt.Errorf("heartbeat: %w: \"epoch\" is missing or empty", ErrMalformed)
	case len(req.Epoch) > MaxEpochBytes:
		return req, fmt.Errorf("heartbeat: %w: \"epoch\" is %d bytes, over %d", ErrMalformed, len(req.Epoch), MaxEpochBytes)
	case loneSurrogate(rawMember(data, func(r *rawMembers) json.RawMessage { return r.Epoch })):
		return req, fmt.Errorf("heartbeat: %w: \"epoch\" is not valid UTF-8 (a lone surrogate escape)", ErrMalformed)
	case req.Seq > math.MaxInt64: // a batch's bound (decoder.seq)
		return req, fmt.Errorf("heartbeat: %w: \"seq\" %d is not an integer in [0, 2^63)", ErrMalformed, req.Seq)
	}
	return req, nil
}

// DecodeLoad decodes and checks the body of P.E.load: a valid request id,
// hex hashes, num_tokens >= 0, at most MaxGroups block lists of at most
// MaxIDs ids in [0, 2^32) each. Whether the lists fit the engine's layout is
// the caller's check. Errors wrap ErrMalformed.
func DecodeLoad(data []byte, lim Limits) (Load, error) {
	lim = lim.WithDefaults()
	var req messages.LoadRequest
	if err := decodeJSON(data, &req); err != nil {
		return Load{}, fmt.Errorf("load: %w", err)
	}
	if err := CheckRequestID(req.Request, lim); err != nil {
		return Load{}, fmt.Errorf("load: %w", err)
	}
	if loneSurrogate(rawMember(data, func(r *rawMembers) json.RawMessage { return r.Request })) {
		return Load{}, fmt.Errorf("load: %w: %w: \"request\" is not valid UTF-8 (a lone surrogate escape)", ErrMalformed, ErrBadRequestID)
	}
	hs, err := decodeHashes(req.Hashes, lim)
	if err != nil {
		return Load{}, fmt.Errorf("load: %w", err)
	}
	if req.NumTokens < 0 {
		return Load{}, fmt.Errorf("load: %w: %w: num_tokens = %d, want >= 0", ErrMalformed, ErrOutOfRange, req.NumTokens)
	}
	if len(req.Blocks) > lim.MaxGroups {
		return Load{}, fmt.Errorf("load: %w: %w: %d block lists, over %d groups", ErrMalformed, ErrTooLarge, len(req.Blocks), lim.MaxGroups)
	}
	blocks := make([][]messages.BlockID, len(req.Blocks))
	for g, ids := range req.Blocks {
		if len(ids) > lim.MaxIDs {
			return Load{}, fmt.Errorf("load: %w: %w: blocks[%d] has %d ids, over %d", ErrMalformed, ErrTooLarge, g, len(ids), lim.MaxIDs)
		}
		blocks[g] = make([]messages.BlockID, len(ids))
		for i, id := range ids {
			if id < 0 || id > MaxBlockID {
				return Load{}, fmt.Errorf("load: %w: %w: blocks[%d][%d] = %d is outside [0, 2^32)", ErrMalformed, ErrOutOfRange, g, i, id)
			}
			blocks[g][i] = messages.BlockID(id)
		}
	}
	return Load{Request: req.Request, Hashes: hs, NumTokens: req.NumTokens, Blocks: blocks}, nil
}

// CheckRequestID applies the protocol's request-id rule: 1..256 (or
// lim.MaxRequestIDBytes) bytes of UTF-8. Errors wrap ErrBadRequestID. The
// engine SDK checks its ids by it too, so both ends keep one rule.
func CheckRequestID(id string, lim Limits) error {
	switch {
	case id == "":
		return fmt.Errorf("%w: %w: missing or empty \"request\"", ErrMalformed, ErrBadRequestID)
	case len(id) > lim.MaxRequestIDBytes:
		return fmt.Errorf("%w: %w: \"request\" is %d bytes, over %d", ErrMalformed, ErrBadRequestID, len(id), lim.MaxRequestIDBytes)
	case !utf8.ValidString(id):
		return fmt.Errorf("%w: %w: \"request\" is not valid UTF-8", ErrMalformed, ErrBadRequestID)
	}
	return nil
}

// decodeHashes hex-decodes wire hashes into one shared string (one
// allocation for all the bytes) sliced per hash.
func decodeHashes(in []string, lim Limits) ([]messages.Hash, error) {
	if len(in) > lim.MaxIDs {
		return nil, fmt.Errorf("%w: %w: %d hashes, over %d", ErrMalformed, ErrTooLarge, len(in), lim.MaxIDs)
	}
	if len(in) == 0 {
		return nil, nil
	}
	n := 0
	for _, h := range in {
		n += len(h) / 2
	}
	raw := make([]byte, 0, n)
	ends := make([]int, len(in))
	for i, h := range in {
		var ok bool
		if raw, ok = appendHash(raw, h, lim.MaxHashBytes); !ok {
			return nil, fmt.Errorf("%w: %w: hashes[%d] is not lowercase hex of even length 2..%d", ErrMalformed, ErrBadHash, i, 2*lim.MaxHashBytes)
		}
		ends[i] = len(raw)
	}
	all := string(raw)
	hs := make([]messages.Hash, len(in))
	prev := 0
	for i, end := range ends {
		hs[i] = messages.Hash(all[prev:end])
		prev = end
	}
	return hs, nil
}
