package ingest

import (
	"bytes"
	"encoding/json"
	"math"
	"strings"
	"testing"
	"unicode/utf8"

	"github.com/stretchr/testify/require"

	"github.com/kvactors/kvactors/messages"
)

// refEvent is an event as encoding/json reads it: the reference of
// FuzzDecodeBatchMatchesEncodingJSON. Block ids are int64, as in
// messages.LoadRequest, and range-checked after.
type refEvent struct {
	Type             string   `json:"type"`
	Request          string   `json:"request"`
	Aborted          bool     `json:"aborted"`
	Group            int      `json:"group"`
	Start            int      `json:"start"`
	PromptTokens     int      `json:"prompt_tokens"`
	MaxOffloadTokens *int     `json:"max_offload_tokens"`
	Computed         int      `json:"computed"`
	Total            int      `json:"total"`
	Hashes           []string `json:"hashes"`
	IDs              []int64  `json:"ids"`
}

// refBatch is the envelope as encoding/json reads it into the types
// messages.EventBatch and messages.HeartbeatRequest use (seq a uint64).
type refBatch struct {
	Epoch  *string           `json:"epoch"`
	Seq    *uint64           `json:"seq"`
	Events []json.RawMessage `json:"events"`
}

// knownKeys are the keys DecodeBatch reads.
var knownKeys = []string{"type", "request", "aborted", "group", "start", "prompt_tokens", "max_offload_tokens", "computed", "total", "hashes", "ids", "epoch", "seq", "events"}

// keysTrouble reports keys that only case-fold to a known key (encoding/json
// matches them, DecodeBatch by choice does not) and duplicate keys in any
// object (DecodeBatch rejects an event on its first bad value, where
// encoding/json may keep a later good one).
func keysTrouble(data []byte) (folded, dup bool) {
	dec := json.NewDecoder(bytes.NewReader(data))
	type frame struct {
		obj  bool
		key  bool
		seen map[string]bool
	}
	var st []frame
	for {
		tok, err := dec.Token()
		if err != nil {
			return
		}
		_, isDelim := tok.(json.Delim)
		isKey := !isDelim && len(st) > 0 && st[len(st)-1].obj && st[len(st)-1].key
		if len(st) > 0 && st[len(st)-1].obj && !(isDelim && (tok == json.Delim('}'))) {
			st[len(st)-1].key = !st[len(st)-1].key
		}
		if isKey {
			k := tok.(string)
			for _, kk := range knownKeys {
				if k != kk && strings.EqualFold(k, kk) {
					folded = true
				}
			}
			if st[len(st)-1].seen[k] {
				dup = true
			}
			st[len(st)-1].seen[k] = true
			continue
		}
		switch tok {
		case json.Delim('{'):
			st = append(st, frame{obj: true, key: true, seen: map[string]bool{}})
		case json.Delim('['):
			st = append(st, frame{})
		case json.Delim('}'), json.Delim(']'):
			st = st[:len(st)-1]
			if len(st) > 0 && st[len(st)-1].obj {
				st[len(st)-1].key = true
			}
		}
	}
}

// refDecodeEvent is one event by encoding/json and PROTOCOL.md's rules.
func refDecodeEvent(raw json.RawMessage, lim Limits) (messages.Event, bool) {
	var r refEvent
	if json.Unmarshal(raw, &r) != nil || bytes.Equal(bytes.TrimSpace(raw), []byte("null")) {
		return messages.Event{}, false
	}
	typ := messages.ParseEventType([]byte(r.Type))
	if typ == 0 || r.Request == "" || len(r.Request) > lim.MaxRequestIDBytes || strings.ContainsRune(r.Request, utf8.RuneError) {
		return messages.Event{}, false
	}
	if r.Group < 0 || r.Group >= lim.MaxGroups || r.Start < 0 || r.PromptTokens < 0 || r.Computed < 0 || r.Total < 0 ||
		(r.MaxOffloadTokens != nil && *r.MaxOffloadTokens < 0) || len(r.Hashes) > lim.MaxIDs || len(r.IDs) > lim.MaxIDs {
		return messages.Event{}, false
	}
	ev := messages.Event{Type: typ, Request: r.Request}
	var hs []messages.Hash
	for _, h := range r.Hashes {
		b, ok := appendHash(nil, h, lim.MaxHashBytes)
		if !ok {
			return messages.Event{}, false
		}
		hs = append(hs, messages.Hash(b))
	}
	switch typ {
	case messages.EvAdded:
		ev.PromptTokens, ev.MaxOffloadTokens = r.PromptTokens, -1
		if r.MaxOffloadTokens != nil {
			ev.MaxOffloadTokens = *r.MaxOffloadTokens
		}
	case messages.EvHashes:
		if r.Start > math.MaxInt-len(hs) {
			return messages.Event{}, false
		}
		ev.Start, ev.Hashes = r.Start, hs
	case messages.EvBlocks:
		if r.Start > math.MaxInt-len(r.IDs) {
			return messages.Event{}, false
		}
		ev.Group, ev.Start = r.Group, r.Start
		for _, id := range r.IDs {
			if id < 0 || id > MaxBlockID {
				return messages.Event{}, false
			}
			ev.IDs = append(ev.IDs, messages.BlockID(id))
		}
	case messages.EvTokens:
		ev.Computed, ev.Total = r.Computed, r.Total
	case messages.EvFinished:
		ev.Aborted, ev.Computed, ev.Total = r.Aborted, r.Computed, r.Total
	}
	return ev, true
}

// FuzzDecodeBatchMatchesEncodingJSON is the differential check: on valid
// UTF-8 JSON without folded keys or lone surrogates, DecodeBatch accepts a
// batch and each event exactly when encoding/json plus PROTOCOL.md's rules
// do, with the same values (with duplicate keys it may only reject more).
func FuzzDecodeBatchMatchesEncodingJSON(f *testing.F) {
	f.Add([]byte(protocolBatch))
	f.Add([]byte(`{"epoch":"e","seq":0,"events":[]}`))
	f.Add([]byte(`{"epoch":"e","seq":1,"events":[{"type":"blocks","request":"r","group":3,"start":2,"ids":[0,1,4294967295]},5,null,{"type":"x"}]}`))
	f.Add([]byte(`{"epoch":"\u00e9","seq":2,"events":[{"type":"hashes","request":"\ud83d\ude00","hashes":["0a0b0c0d","ff"],"start":9}],"x":[{}]}`))
	f.Add([]byte(`{"epoch":"e","seq":3,"events":[{"type":"added","request":"r","prompt_tokens":4,"max_offload_tokens":0},{"type":"finished","request":"r","aborted":false,"computed":1,"total":2}]}`))
	f.Add([]byte(`{"epoch":"e","seq":-0,"events":[]}`))
	f.Add([]byte(`{"epoch":"e","seq":1,"events":[{"type":"blocks","request":"r","ids":[-0]}]}`))
	f.Add([]byte(`{"epoch":"e","seq":1,"events":[{"type":"blocks","request":"r","ids":[1],"ids":null}]}`))
	f.Add([]byte(`{"epoch":"e","seq":1,"events":[{"type":"tokens","request":"r","request":null}]}`))
	f.Add([]byte(`{"epoch":"e","seq":1,"events":[{"type":"tokens","request":"r","computed":1E0}]}`))
	f.Add([]byte(`{"epoch":"e","seq":1,"events":[{"type":"tokens","request":"r","total":9223372036854775808}]}`))
	f.Add([]byte(`{"epoch":"e","seq":9223372036854775808,"events":[]}`))
	f.Add([]byte(`{"epoch":"e","seq":1,"events":[{"type":"hashes","request":"r","hashes":["\u0061a"]}]}`))
	f.Add([]byte(`{"epoch":"e","seq":1,"events":[{"type":"added","request":"r","max_offload_tokens":3,"max_offload_tokens":null}]}`))
	f.Add([]byte(`{"epoch":"e","seq":1,"events":[{"type":"added","request":"r\u0000"}]}`))
	f.Add([]byte(`{"epoch":"e","seq":1,"events":[{"type":"added","request":"\u00e9"}], "epoch":"f"}`))
	f.Fuzz(func(t *testing.T, data []byte) {
		lim := fuzzLimits.WithDefaults()
		b, bad, err := DecodeBatch("e1", data, fuzzLimits)
		if !json.Valid(data) {
			require.Error(t, err)
			return
		}
		if !utf8.Valid(data) {
			return // encoding/json replaces what DecodeBatch rejects
		}
		folded, dup := keysTrouble(data)
		if folded {
			return
		}
		var rb refBatch
		refOK := json.Unmarshal(data, &rb) == nil && rb.Epoch != nil && *rb.Epoch != "" && len(*rb.Epoch) <= MaxEpochBytes &&
			!strings.ContainsRune(*rb.Epoch, utf8.RuneError) && rb.Seq != nil && *rb.Seq <= math.MaxInt64 && rb.Events != nil && len(rb.Events) <= lim.MaxEvents
		if strings.ContainsRune(string(data), utf8.RuneError) || bytes.Contains(bytes.ToLower(data), []byte(`\ud`)) ||
			bytes.Contains(bytes.ToLower(data), []byte(`\ufffd`)) {
			return // lone surrogates: encoding/json replaces what DecodeBatch rejects
		}
		if err != nil {
			if !dup {
				require.False(t, refOK, "decoder rejected what the reference accepts: %v", err)
			}
			return
		}
		require.True(t, refOK, "decoder accepted a batch the reference rejects")
		require.Equal(t, *rb.Epoch, b.Epoch)
		require.Equal(t, *rb.Seq, b.Seq)
		var want []messages.Event
		nbad := 0
		for _, raw := range rb.Events {
			ev, ok := refDecodeEvent(raw, lim)
			if ok {
				want = append(want, ev)
			} else {
				nbad++
			}
		}
		rejected := 0
		for _, e := range bad {
			rejected += e.Count
		}
		if dup {
			// Duplicate keys: DecodeBatch may reject more, never other values.
			require.GreaterOrEqual(t, rejected, nbad)
			return
		}
		require.Equal(t, nbad, rejected, "bad: %v", bad)
		require.Equal(t, len(want), len(b.Events))
		for i := range want {
			w, g := want[i], b.Events[i]
			if len(w.Hashes) == 0 && len(g.Hashes) == 0 {
				w.Hashes, g.Hashes = nil, nil
			}
			if len(w.IDs) == 0 && len(g.IDs) == 0 {
				w.IDs, g.IDs = nil, nil
			}
			require.Equal(t, w, g, "event %d", i)
		}
	})
}
