package cluster

import (
	"context"
	"errors"
	"fmt"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"

	"github.com/kvactors/kvactors/cluster/ownership"
)

// leaderReads opens what leaderRead reads through: js's connection and API
// prefix, with nats.go's JetStream API, whose message get is the stream
// leader's STREAM.MSG.GET unless asked for a direct get (jetstream's
// KeyValue always asks for one on a bucket that allows them).
func leaderReads(js jetstream.JetStream) (nats.JetStreamContext, error) {
	var opt nats.JSOpt
	switch o := js.Options(); {
	case o.Domain != "":
		opt = nats.Domain(o.Domain)
	case o.APIPrefix != "":
		opt = nats.APIPrefix(o.APIPrefix)
	default:
		opt = nats.APIPrefix(jetstream.DefaultAPIPrefix)
	}
	return js.Conn().JetStream(opt)
}

// leaderRead reads engine's last write at the bucket stream's leader, not
// by a direct get: any replica answers those (a queue group's pick), one
// that has not caught up included: nats-server subscribes a follower to
// them once it is current, and does not unsubscribe it when it falls
// behind (a server whose routes were cut). e is the record, nil if
// none: never written, or its marker lapsed too (rev 0), or deleted,
// purged or lapsed (rev is the marker's). A leader deposed but not yet
// told may still answer from its store.
func (o *Owners) leaderRead(ctx context.Context, engine string) (e *ownership.Entry, rev uint64, err error) {
	if o.lead == nil {
		return nil, 0, fmt.Errorf("read owner of engine %s at the stream leader: no JetStream API", engine)
	}
	ctx, cancel := context.WithTimeout(ctx, o.cfg.Lease/8) // one read: one that goes unanswered leaves the rest of the wait to others
	defer cancel()
	m, err := o.lead.GetLastMsg("KV_"+o.cfg.Bucket, "$KV."+o.cfg.Bucket+"."+engine, nats.Context(ctx))
	switch {
	case errors.Is(err, nats.ErrMsgNotFound):
		return nil, 0, nil
	case err != nil:
		return nil, 0, fmt.Errorf("read owner of engine %s at the stream leader: %w", engine, err)
	}
	// What jetstream's KeyValue takes for a delete: its own markers, and
	// the servers' (a lapse: MaxAge).
	if op := m.Header.Get("KV-Operation"); op == "DEL" || op == "PURGE" || m.Header.Get(jetstream.MarkerReasonHeader) != "" {
		return nil, m.Sequence, nil
	}
	r, err := ownership.DecodeRecord(m.Data)
	if err != nil {
		return nil, 0, fmt.Errorf("owner of engine %s: %w", engine, err)
	}
	return &ownership.Entry{Record: r, Revision: m.Sequence}, m.Sequence, nil
}
