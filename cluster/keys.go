package cluster

import (
	"context"
	"encoding/hex"
	"encoding/json"
	"errors"
	"fmt"
	"slices"
	"strings"
	"time"

	"github.com/nats-io/nats.go"

	"github.com/kvactors/kvactors/cluster/holders"
	"github.com/kvactors/kvactors/messages"
)

// VerbKeys is the catch-up verb: P._node.<node>.keys, request/reply (the
// protocol word is messages.NodeVerbKeys).
const VerbKeys = messages.NodeVerbKeys

// Catch-up wire. Request: {"after":{"namespace":"m","key":"<hex>"}} (omit
// "after" for the first page). Reply: {"node","boot","keys":[{"namespace",
// "key"}…],"done":bool} or {"error":"…"}: the node's keys in (namespace,
// key) order after "after", as many as fit under the serving connection's
// max_payload. The client asks again after the last key until done.
type keysRequest struct {
	After *wireKey `json:"after,omitempty"`
}

type wireKey struct {
	Namespace string `json:"namespace"`
	Key       string `json:"key"`
}

type keysReply struct {
	Node  string    `json:"node"`
	Boot  string    `json:"boot"`
	Keys  []wireKey `json:"keys"`
	Done  bool      `json:"done"`
	Error string    `json:"error,omitempty"`
}

// KeySource lists a node's keys in (namespace, key) order: at most max of
// them after after (all from the start when after is the zero NSKey).
type KeySource interface {
	KeysAfter(after holders.NSKey, max int) []holders.NSKey
}

// SortedKeys is a KeySource over a snapshot.
type SortedKeys []holders.NSKey

// NewSortedKeys sorts keys into a KeySource.
func NewSortedKeys(keys []holders.NSKey) SortedKeys {
	s := slices.Clone(keys)
	slices.SortFunc(s, compareNSKey)
	return SortedKeys(s)
}

func compareNSKey(a, b holders.NSKey) int {
	if c := strings.Compare(a.NS, b.NS); c != 0 {
		return c
	}
	return strings.Compare(string(a.Key), string(b.Key))
}

// KeysAfter implements KeySource.
func (s SortedKeys) KeysAfter(after holders.NSKey, max int) []holders.NSKey {
	i := 0
	if after != (holders.NSKey{}) {
		i, _ = slices.BinarySearchFunc(s, after, compareNSKey)
		if i < len(s) && s[i] == after {
			i++
		}
	}
	return s[i:min(len(s), i+max)]
}

// Apply returns the set with changes applied (true: the key is in the set
// now, false: it is not), in one pass over s: a set kept sorted costs one
// merge per change of it, not a sort. s is not modified.
func (s SortedKeys) Apply(changes map[holders.NSKey]bool) SortedKeys {
	added := make([]holders.NSKey, 0, len(changes))
	for k, in := range changes {
		if in {
			added = append(added, k)
		}
	}
	slices.SortFunc(added, compareNSKey)
	out := make(SortedKeys, 0, len(s)+len(added))
	for _, k := range s {
		if _, changed := changes[k]; changed {
			continue // dropped, or among added
		}
		for len(added) > 0 && compareNSKey(added[0], k) < 0 {
			out, added = append(out, added[0]), added[1:]
		}
		out = append(out, k)
	}
	return append(out, added...)
}

// ServeKeys answers P._node.<node>.keys from src.
func ServeKeys(nc *nats.Conn, prefix, node, boot string, src KeySource) (*nats.Subscription, error) {
	subj := messages.NodeSubject(prefix, node, VerbKeys)
	sub, err := nc.Subscribe(subj, func(m *nats.Msg) {
		rep := keysPage(nc.MaxPayload()-messages.HeaderRoom, m.Data, src)
		rep.Node, rep.Boot = node, boot
		b, _ := json.Marshal(rep)
		_ = m.Respond(b)
	})
	if err != nil {
		return nil, fmt.Errorf("subscribe %s: %w", subj, err)
	}
	return sub, nil
}

// minKeyCost is the least a key adds to a page: the JSON of a one-byte key
// in the empty namespace, rounded down.
const minKeyCost = 34

func keysPage(budget int64, body []byte, src KeySource) keysReply {
	var req keysRequest
	if err := json.Unmarshal(body, &req); err != nil {
		return keysReply{Error: fmt.Sprintf("bad keys request: %v", err)}
	}
	var after holders.NSKey
	if req.After != nil {
		raw, err := hex.DecodeString(req.After.Key)
		if err != nil || len(raw) == 0 {
			return keysReply{Error: fmt.Sprintf("bad keys request: key %q", req.After.Key)}
		}
		after = holders.NSKey{NS: req.After.Namespace, Key: messages.Key(raw)}
	}
	rep := keysReply{Keys: []wireKey{}}
	used := int64(256) // node, boot, field names
	for {
		// One ask for at least as many keys as can fit: a source may pay a
		// pass over its whole set per ask (a page of N asks of a fixed size
		// made a catch-up quadratic in the set's size). The loop is for keys
		// costing less than minKeyCost, which no source makes.
		want := int((budget-used)/minKeyCost) + 1
		batch := src.KeysAfter(after, want)
		for _, k := range batch {
			w := wireKey{Namespace: k.NS, Key: hex.EncodeToString([]byte(k.Key))}
			// JSON escaping can at most sextuple a namespace byte.
			cost := int64(6*len(w.Namespace) + len(w.Key) + 32)
			if used+cost > budget {
				return rep
			}
			used += cost
			rep.Keys = append(rep.Keys, w)
			after = k
		}
		if len(batch) < want {
			rep.Done = true
			return rep
		}
	}
}

// Errors of CatchUp.
var ErrCatchUp = errors.New("cluster: key catch-up")

// CatchUp asks node for its whole key set, page by page, calling page for
// each (with the boot the node answered with). A boot that changes between
// pages is an error: the caller starts again for the new boot.
func CatchUp(ctx context.Context, nc *nats.Conn, prefix, node string, timeout time.Duration, page func(boot string, keys []holders.NSKey) error) error {
	subj := messages.NodeSubject(prefix, node, VerbKeys)
	var (
		req   keysRequest
		boot  string
		after holders.NSKey // the last key read: each page's keys must come after it, in order
	)
	for {
		body, _ := json.Marshal(req)
		rctx, cancel := context.WithTimeout(ctx, timeout)
		m, err := nc.RequestWithContext(rctx, subj, body)
		cancel()
		if err != nil {
			return fmt.Errorf("%w from node %s: %w", ErrCatchUp, node, err)
		}
		var rep keysReply
		if err := json.Unmarshal(m.Data, &rep); err != nil {
			return fmt.Errorf("%w from node %s: reply: %w", ErrCatchUp, node, err)
		}
		if rep.Error != "" {
			return fmt.Errorf("%w from node %s: %s", ErrCatchUp, node, rep.Error)
		}
		if boot == "" {
			boot = rep.Boot
		} else if rep.Boot != boot {
			return fmt.Errorf("%w from node %s: boot changed from %s to %s", ErrCatchUp, node, boot, rep.Boot)
		}
		keys := make([]holders.NSKey, 0, len(rep.Keys))
		for _, w := range rep.Keys {
			raw, err := hex.DecodeString(w.Key)
			if err != nil || len(raw) == 0 {
				return fmt.Errorf("%w from node %s: key %q", ErrCatchUp, node, w.Key)
			}
			k := holders.NSKey{NS: w.Namespace, Key: messages.Key(raw)}
			// A page that does not move past the last key (a peer that
			// ignores "after") would be asked for again for ever.
			if after != (holders.NSKey{}) && compareNSKey(k, after) <= 0 {
				return fmt.Errorf("%w from node %s: page does not advance: key %q of namespace %q is not after the last one read",
					ErrCatchUp, node, w.Key, w.Namespace)
			}
			after = k
			keys = append(keys, k)
		}
		if err := page(boot, keys); err != nil {
			return err
		}
		if rep.Done {
			return nil
		}
		if len(rep.Keys) == 0 {
			return fmt.Errorf("%w from node %s: empty page before the end", ErrCatchUp, node)
		}
		last := rep.Keys[len(rep.Keys)-1]
		req.After = &last
	}
}
