package cluster

import (
	"context"
	"encoding/json"
	"fmt"
	"io"
	"slices"
	"strings"
	"sync"
	"text/tabwriter"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"

	"github.com/kvactors/kvactors/messages"
)

// HeartbeatUsage is a node heartbeat with the usage fields `kvactors nodes`
// shows (optional fields of messages.NodeHeartbeat).
type HeartbeatUsage = messages.NodeHeartbeat

// NodeRow is one line of `kvactors nodes`.
type NodeRow struct {
	Node    string
	Boot    string   // "" if no heartbeat was heard
	Engines []string // owned in the ownership bucket
	// Reported is the engine count of the last heartbeat (-1: none heard).
	Reported int
	Usage    HeartbeatUsage
	// Age is the age of the last heartbeat heard at the end of the survey;
	// -1 if none was heard.
	Age time.Duration
}

// maxSurveyWait bounds what a heard lease stretches a survey to (SurveyWait).
const maxSurveyWait = time.Minute

// SurveyWait is how long a survey listens to hear every live node of a
// cluster whose lease is lease: a node heartbeats every lease/4, and a
// fifth of that again lets a late one in (3 s at the default 10 s lease).
// At most a minute.
func SurveyWait(lease time.Duration) time.Duration {
	return min(lease*3/10, maxSurveyWait)
}

// BucketLease is the lease of the ownership bucket's nodes: the bucket's
// TTL (OpenOwners makes it their lease, and refuses a node of another).
func BucketLease(ctx context.Context, js jetstream.JetStream, bucket string) (time.Duration, error) {
	st, err := bucketStatus(ctx, js, bucket)
	if err != nil {
		return 0, err
	}
	return st.TTL(), nil
}

// bucketStatus reads the existing ownership bucket's status (its settings).
func bucketStatus(ctx context.Context, js jetstream.JetStream, bucket string) (jetstream.KeyValueStatus, error) {
	kv, err := js.KeyValue(ctx, bucket)
	if err != nil {
		return nil, fmt.Errorf("ownership bucket %s: %w", bucket, err)
	}
	st, err := kv.Status(ctx)
	if err != nil {
		return nil, fmt.Errorf("ownership bucket %s: status: %w", bucket, err)
	}
	return st, nil
}

// Survey listens to node heartbeats for wait, or longer when a heartbeat
// says its node's lease needs it (SurveyWait from the start: the other
// nodes beat as seldom), and joins them with the owners in table (nil:
// none), one row per node, sorted by node id. A node that owns engines
// and sent no heartbeat is listed with Age -1: its lease is running out.
// Pass at least SurveyWait of the cluster's lease (BucketLease) to hear
// every live node.
func Survey(ctx context.Context, nc *nats.Conn, prefix string, table *OwnerTable, wait time.Duration) ([]NodeRow, error) {
	type heard struct {
		hb HeartbeatUsage
		at time.Time
	}
	start := time.Now()
	var (
		mu    sync.Mutex
		last  = map[string]heard{}
		until = start.Add(wait) // stretched by a heard lease
	)
	subj := messages.NodeSubject(prefix, "*", messages.NodeVerbHeartbeat)
	sub, err := nc.Subscribe(subj, func(m *nats.Msg) {
		var hb HeartbeatUsage
		if json.Unmarshal(m.Data, &hb) != nil || hb.Node == "" {
			return // not a heartbeat: nothing to show
		}
		mu.Lock()
		last[hb.Node] = heard{hb, time.Now()}
		if need := start.Add(SurveyWait(time.Duration(hb.LeaseMS) * time.Millisecond)); need.After(until) {
			until = need
		}
		mu.Unlock()
	})
	if err != nil {
		return nil, fmt.Errorf("subscribe %s: %w", subj, err)
	}
	defer func() { _ = sub.Unsubscribe() }()
	timer := time.NewTimer(wait)
	defer timer.Stop()
	for {
		select {
		case <-ctx.Done():
			return nil, ctx.Err()
		case <-timer.C:
		}
		mu.Lock()
		left := time.Until(until)
		mu.Unlock()
		if left <= 0 {
			break
		}
		timer.Reset(left)
	}
	end := time.Now()
	mu.Lock()
	defer mu.Unlock()
	rows := map[string]*NodeRow{}
	for node, h := range last {
		rows[node] = &NodeRow{Node: node, Boot: h.hb.Boot, Reported: h.hb.Engines, Usage: h.hb, Age: end.Sub(h.at)}
	}
	if table != nil {
		for node, engines := range table.ByNode() {
			r := rows[node]
			if r == nil {
				r = &NodeRow{Node: node, Reported: -1, Age: -1}
				rows[node] = r
			}
			r.Engines = engines
		}
	}
	out := make([]NodeRow, 0, len(rows))
	for _, r := range rows {
		out = append(out, *r)
	}
	slices.SortFunc(out, func(a, b NodeRow) int { return strings.Compare(a.Node, b.Node) })
	return out, nil
}

// WriteNodes prints rows as the `kvactors nodes` table.
func WriteNodes(w io.Writer, rows []NodeRow) error {
	tw := tabwriter.NewWriter(w, 0, 4, 2, ' ', 0)
	fmt.Fprintln(tw, "NODE\tBOOT\tENGINES\tOWNED\tPOOL\tDISK\tLAST HEARTBEAT")
	for _, r := range rows {
		boot, reported, age := r.Boot, fmt.Sprint(r.Reported), r.Age.Round(time.Millisecond).String()+" ago"
		if r.Age < 0 {
			boot, reported, age = "-", "-", "none (lease running out)"
		}
		owned := strings.Join(r.Engines, ",")
		if owned == "" {
			owned = "-"
		}
		fmt.Fprintf(tw, "%s\t%s\t%s\t%s\t%s\t%s\t%s\n", r.Node, boot, reported, owned,
			usage(r.Usage.PoolBytes, r.Usage.PoolCapacityBytes), usage(r.Usage.DiskBytes, 0), age)
	}
	return tw.Flush()
}

func usage(used, capacity int64) string {
	switch {
	case used == 0 && capacity == 0:
		return "-"
	case capacity == 0:
		return mib(used)
	}
	return mib(used) + "/" + mib(capacity)
}

func mib(b int64) string { return fmt.Sprintf("%.1fMiB", float64(b)/(1<<20)) }
