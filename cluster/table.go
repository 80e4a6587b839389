package cluster

import (
	"context"
	"fmt"
	"slices"
	"sync"

	"github.com/nats-io/nats.go/jetstream"

	"github.com/kvactors/kvactors/cluster/ownership"
)

// OwnerTable is a live copy of the ownership bucket, kept by a KV watch:
// the cached entry that Owners.Decide takes for every message other than
// register, and the engines per node that `kvactors nodes` shows. A lapse
// reaches it as the servers' expiry marker, a release as a delete. It may
// lag the bucket; nothing is claimed on its word (claims are CAS).
type OwnerTable struct {
	w    jetstream.KeyWatcher
	done chan struct{}

	mu      sync.Mutex
	entries map[string]ownership.Entry
	bad     uint64 // records that did not decode
}

// WatchOwners starts the watch and returns once the table holds the
// bucket's current records (or ctx ends).
func (o *Owners) WatchOwners(ctx context.Context) (*OwnerTable, error) {
	return watchOwners(ctx, o.kv)
}

// WatchBucket watches an existing ownership bucket without joining the
// cluster (`kvactors nodes`): jetstream.ErrBucketNotFound (wrapped) if no
// node has made it yet.
func WatchBucket(ctx context.Context, js jetstream.JetStream, bucket string) (*OwnerTable, error) {
	kv, err := js.KeyValue(ctx, bucket)
	if err != nil {
		return nil, fmt.Errorf("ownership bucket %s: %w", bucket, err)
	}
	return watchOwners(ctx, kv)
}

func watchOwners(ctx context.Context, kv jetstream.KeyValue) (*OwnerTable, error) {
	w, err := kv.WatchAll(context.Background())
	if err != nil {
		return nil, fmt.Errorf("watch ownership bucket: %w", err)
	}
	t := &OwnerTable{w: w, done: make(chan struct{}), entries: map[string]ownership.Entry{}}
	synced := make(chan struct{})
	go t.run(synced)
	select {
	case <-synced:
		return t, nil
	case <-ctx.Done():
		t.Stop()
		return nil, fmt.Errorf("watch ownership bucket: initial values: %w", ctx.Err())
	}
}

// run applies updates until the watch stops; the first nil update marks
// the end of the initial values.
func (t *OwnerTable) run(synced chan struct{}) {
	defer close(t.done)
	for e := range t.w.Updates() {
		if e == nil {
			if synced != nil {
				close(synced)
				synced = nil
			}
			continue
		}
		t.apply(e)
	}
}

func (t *OwnerTable) apply(e jetstream.KeyValueEntry) {
	t.mu.Lock()
	defer t.mu.Unlock()
	if e.Operation() != jetstream.KeyValuePut {
		delete(t.entries, e.Key())
		return
	}
	r, err := ownership.DecodeRecord(e.Value())
	if err != nil {
		t.bad++
		delete(t.entries, e.Key())
		return
	}
	t.entries[e.Key()] = ownership.Entry{Record: r, Revision: e.Revision()}
}

// Stop ends the watch and waits for it.
func (t *OwnerTable) Stop() {
	_ = t.w.Stop()
	<-t.done
}

// Get returns engine's entry, nil if none.
func (t *OwnerTable) Get(engine string) *ownership.Entry {
	t.mu.Lock()
	defer t.mu.Unlock()
	e, ok := t.entries[engine]
	if !ok {
		return nil
	}
	return &e
}

// ByNode returns the engines each node owns, sorted (a closed marker is
// no one's).
func (t *OwnerTable) ByNode() map[string][]string {
	t.mu.Lock()
	defer t.mu.Unlock()
	out := map[string][]string{}
	for engine, e := range t.entries {
		if e.Closed {
			continue // its node shut down: nobody owns it
		}
		out[e.Node] = append(out[e.Node], engine)
	}
	for _, es := range out {
		slices.Sort(es)
	}
	return out
}

// BadRecords counts records that did not decode (left out of the table).
func (t *OwnerTable) BadRecords() uint64 {
	t.mu.Lock()
	defer t.mu.Unlock()
	return t.bad
}
