package seat_test

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"sort"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"
	"github.com/stretchr/testify/require"

	provisioner "github.com/novox/mesh-provisioner"
	"github.com/novox/mesh-provisioner/fixtures"
	"github.com/novox/mesh-provisioner/internal/natstest"
	"github.com/novox/mesh-provisioner/projector"
	"github.com/novox/mesh-provisioner/query"
	"github.com/novox/mesh-provisioner/seat"
	"github.com/novox/mesh-provisioner/store"
)

// accountsConf is the shipped configuration; the test loads it as is (listen and store_dir are the
// test's own).
const accountsConf = "../docs/nats-accounts.conf"

// user is a connection as one user of docs/nats-accounts.conf that records every permission
// violation the server reports to it.
type user struct {
	name string
	nc   *nats.Conn
	js   jetstream.JetStream

	mu         sync.Mutex
	violations []error
	expected   map[string]bool // subjects the test made it publish to on purpose
}

func connectAs(t *testing.T, url, name, password, inboxPrefix string) *user {
	t.Helper()
	u := &user{name: name, expected: map[string]bool{}}
	u.nc, u.js = natstest.Connect(t, url, nats.UserInfo(name, password), nats.CustomInboxPrefix(inboxPrefix),
		nats.ErrorHandler(func(_ *nats.Conn, _ *nats.Subscription, err error) {
			if errors.Is(err, nats.ErrPermissionViolation) {
				u.mu.Lock()
				u.violations = append(u.violations, err)
				u.mu.Unlock()
			}
		}))
	return u
}

// violated reports whether the server refused a publish of this user to subject.
func (u *user) violated(subject string) bool {
	u.mu.Lock()
	defer u.mu.Unlock()
	want := fmt.Sprintf("Publish to %q", subject)
	for _, err := range u.violations {
		if strings.Contains(err.Error(), want) {
			return true
		}
	}
	return false
}

// refused runs a write that must be refused: NATS answers a publish it does not permit with a
// permissions violation (an -ERR to the client, not a reply), so the test waits for that error on
// subject, then stops the write, which must not have succeeded.
func (u *user) refused(t *testing.T, subject string, write func(ctx context.Context) error) {
	t.Helper()
	u.mu.Lock()
	u.expected[subject] = true
	u.mu.Unlock()
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	done := make(chan error, 1)
	go func() { done <- write(ctx) }()
	natstest.CheckFor(t, 10*time.Second, 5*time.Millisecond, func() error {
		if u.violated(subject) {
			return nil
		}
		select {
		case err := <-done:
			done <- err
			if err == nil {
				return fmt.Errorf("%s: the write to %s succeeded", u.name, subject)
			}
		default:
		}
		return fmt.Errorf("%s: no permissions violation for %s", u.name, subject)
	})
	cancel()
	require.Error(t, <-done, "%s: the write to %s must not succeed", u.name, subject)
}

// unexpected lists the violations the test did not provoke: a permission the seat needs and the
// configuration lacks shows up here.
func (u *user) unexpected() []string {
	u.mu.Lock()
	defer u.mu.Unlock()
	var out []string
	for _, err := range u.violations {
		ok := false
		for subj := range u.expected {
			if strings.Contains(err.Error(), fmt.Sprintf("Publish to %q", subj)) {
				ok = true
			}
		}
		if !ok {
			out = append(out, err.Error())
		}
	}
	return out
}

func askAs(t *testing.T, u *user, req string) natstest.Answer {
	t.Helper()
	a, _, err := natstest.Ask(u.nc, query.Subject, []byte(req), false)
	require.NoError(t, err, "%s asks %s", u.name, req)
	return a
}

func TestAccounts_LeastPrivilege(t *testing.T) {
	t.Parallel()
	ns := natstest.RunServerAt(t, "127.0.0.1:-1", t.TempDir(), accountsConf)
	url := ns.ClientURL()
	ctx := context.Background()

	// The operator creates the nodes' buckets; the seat creates the registry's itself.
	admin := connectAs(t, url, "mesh-admin", "admin-change-me", "_INBOX.admin")
	require.NoError(t, fixtures.CreateBuckets(ctx, admin.js, provisioner.BucketNeeds, provisioner.BucketApplied, provisioner.BucketCollect))

	prov := connectAs(t, url, "mesh-provisioner", "provisioner-change-me", "_INBOX.mesh-provisioner")
	db, err := store.OpenState(t.TempDir(), store.Options{})
	require.NoError(t, err)
	st, err := seat.Start(ctx, prov.nc, prov.js, db, seat.Config{WriteRegistry: true, Plans: true, Projector: projector.Options{Poll: 50 * time.Millisecond}})
	require.NoError(t, err)
	t.Cleanup(func() {
		require.NoError(t, st.Stop())
		require.NoError(t, db.Close())
	})

	t.Run("the seat writes the registry", func(t *testing.T) {
		natstest.CheckFor(t, 10*time.Second, 10*time.Millisecond, func() error {
			if p, _ := st.Registry.Stats(); p == 0 {
				return fmt.Errorf("no registry pass yet (%d failed)", st.Registry.Failures())
			}
			return nil
		})
		kv, err := admin.js.KeyValue(ctx, provisioner.BucketRegistry)
		require.NoError(t, err)
		keys, err := kv.Keys(ctx)
		require.NoError(t, err)
		var kinds []string
		for _, e := range provisioner.Registry.Entries {
			kinds = append(kinds, e.Kind)
		}
		require.Equal(t, kinds, keys)
	})

	n1 := connectAs(t, url, "node-n1", "n1-change-me", "_INBOX.node.n1")

	t.Run("node n1 reads the registry through the verb", func(t *testing.T) {
		natstest.CheckFor(t, 10*time.Second, 10*time.Millisecond, func() error {
			a, _, err := natstest.Ask(n1.nc, query.Subject, []byte(`{"what":"registry"}`), false)
			if err != nil {
				return err
			}
			if len(a.Rows) != len(provisioner.Registry.Entries) {
				return fmt.Errorf("%d registry rows", len(a.Rows))
			}
			return nil
		})
	})

	t.Run("node n1 writes its own keys, and the seat answers them", func(t *testing.T) {
		for _, tc := range []struct{ bucket, key, what string }{
			{provisioner.BucketNeeds, "n1.mod-a.config.listen", "needs"},
			{provisioner.BucketApplied, "n1.mod-a", "applied"},
			{provisioner.BucketCollect, "n1.shell=3Azsh.mod-a", "collect"},
		} {
			kv, err := n1.js.KeyValue(ctx, tc.bucket)
			require.NoError(t, err, tc.bucket)
			seq, err := kv.Put(ctx, tc.key, []byte{0x81, 0xa1, 'v', 0x01})
			require.NoError(t, err, tc.key)
			e, err := kv.Get(ctx, tc.key)
			require.NoError(t, err, "n1 reads back its own key")
			require.Equal(t, seq, e.Revision())
			seq, err = kv.Update(ctx, tc.key, []byte{0x81, 0xa1, 'v', 0x02}, seq)
			require.NoError(t, err, "n1 updates its own key at a revision")

			a := askAs(t, n1, fmt.Sprintf(`{"what":%q,"node":"n1","min_seq":%d,"wait_ms":5000}`, tc.what, seq))
			require.Len(t, a.Rows, 1, tc.what)
			require.Equal(t, tc.key, a.Rows[0]["key"])
			require.Equal(t, fmt.Sprint(seq), fmt.Sprint(a.Rows[0]["revision"]))
		}
	})

	t.Run("node n1 is refused on other nodes' keys and on the registry", func(t *testing.T) {
		for _, tc := range []struct{ bucket, key string }{
			{provisioner.BucketNeeds, "n2.mod-a.config.listen"},
			{provisioner.BucketApplied, "n2.mod-a"},
			{provisioner.BucketCollect, "n2.shell.mod-a"},
			{provisioner.BucketNeeds, "n10.mod-a.config.listen"}, // n1 is a token, not a prefix
			{provisioner.BucketRegistry, "config"},
			{provisioner.BucketRegistry, "gadget"},
		} {
			kv, err := n1.js.KeyValue(ctx, tc.bucket)
			require.NoError(t, err, tc.bucket)
			n1.refused(t, provisioner.SubjectPrefix(tc.bucket)+tc.key, func(ctx context.Context) error {
				_, err := kv.Put(ctx, tc.key, []byte{0x80})
				return err
			})
		}
	})

	t.Run("the seat is refused on the nodes' buckets", func(t *testing.T) {
		for _, tc := range []struct{ bucket, key string }{
			{provisioner.BucketNeeds, "n1.mod-a.config.listen"},
			{provisioner.BucketApplied, "n1.mod-a"},
			{provisioner.BucketCollect, "n1.shell.mod-a"},
		} {
			kv, err := prov.js.KeyValue(ctx, tc.bucket)
			require.NoError(t, err, "the seat opens %s to read it", tc.bucket)
			prov.refused(t, provisioner.SubjectPrefix(tc.bucket)+tc.key, func(ctx context.Context) error {
				_, err := kv.Put(ctx, tc.key, []byte{0x80})
				return err
			})
			prov.refused(t, provisioner.SubjectPrefix(tc.bucket)+tc.key, func(ctx context.Context) error {
				return kv.Delete(ctx, tc.key)
			})
		}
		stream, err := prov.js.Stream(ctx, provisioner.StreamName(provisioner.BucketNeeds))
		require.NoError(t, err)
		prov.refused(t, "$JS.API.STREAM.PURGE."+provisioner.StreamName(provisioner.BucketNeeds), func(ctx context.Context) error {
			return stream.Purge(ctx)
		})
		prov.refused(t, "$JS.API.STREAM.DELETE."+provisioner.StreamName(provisioner.BucketApplied), func(ctx context.Context) error {
			return prov.js.DeleteStream(ctx, provisioner.StreamName(provisioner.BucketApplied))
		})
	})

	t.Run("nothing refused was written", func(t *testing.T) {
		for _, b := range []string{provisioner.BucketNeeds, provisioner.BucketApplied, provisioner.BucketCollect} {
			kv, err := admin.js.KeyValue(ctx, b)
			require.NoError(t, err)
			keys, err := kv.Keys(ctx)
			require.NoError(t, err)
			for _, k := range keys {
				require.True(t, strings.HasPrefix(k, "n1."), "%s holds %s", b, k)
			}
			st, err := kv.Status(ctx)
			require.NoError(t, err)
			require.EqualValues(t, 2, st.Values(), "%s: n1's put and update, nothing else", b)
		}
		_, err := admin.js.Stream(ctx, provisioner.StreamName(provisioner.BucketApplied))
		require.NoError(t, err, "the applied stream is still there")
	})

	t.Run("micro discovery answers", func(t *testing.T) {
		msg, err := admin.nc.Request("$SRV.INFO."+query.ServiceName, nil, 5*time.Second)
		require.NoError(t, err)
		var info struct {
			Name      string `json:"name"`
			Endpoints []struct {
				Subject string `json:"subject"`
			} `json:"endpoints"`
		}
		require.NoError(t, json.Unmarshal(msg.Data, &info))
		require.Equal(t, query.ServiceName, info.Name)
		require.Len(t, info.Endpoints, 1)
		require.Equal(t, query.Subject, info.Endpoints[0].Subject)
	})

	// Everything the seat and the node did, besides what the test provoked, was permitted: the
	// configuration grants what they need.
	for _, u := range []*user{prov, n1, admin} {
		v := u.unexpected()
		sort.Strings(v)
		require.Empty(t, v, "%s: permissions violations the test did not provoke", u.name)
	}
}

// TestAccounts_ANodesRollupReachesEveryNode: what docs/accounts.md warns of. NATS checks a publish's
// subject, not the reach of its Nats-Rollup: node-n1, publishing on one of its own keys with
// `Nats-Rollup: all`, removes node n2's keys from the bucket. With the stream's allow_rollup_hdrs
// off, the same publish and a KV purge are refused, while puts and deletes go on.
func TestAccounts_ANodesRollupReachesEveryNode(t *testing.T) {
	t.Parallel()
	ns := natstest.RunServerAt(t, "127.0.0.1:-1", t.TempDir(), accountsConf)
	url := ns.ClientURL()
	ctx := context.Background()
	admin := connectAs(t, url, "mesh-admin", "admin-change-me", "_INBOX.admin")
	require.NoError(t, fixtures.CreateBuckets(ctx, admin.js, provisioner.BucketNeeds))
	akv, err := admin.js.KeyValue(ctx, provisioner.BucketNeeds)
	require.NoError(t, err)
	n1 := connectAs(t, url, "node-n1", "n1-change-me", "_INBOX.node.n1")
	kv, err := n1.js.KeyValue(ctx, provisioner.BucketNeeds)
	require.NoError(t, err)
	rollupAll := func() error {
		m := nats.NewMsg(provisioner.SubjectPrefix(provisioner.BucketNeeds) + "n1.m.config.x")
		m.Header.Set(provisioner.HeaderRollup, "all")
		_, err := n1.js.PublishMsg(ctx, m)
		return err
	}

	_, err = akv.Put(ctx, "n2.m.config.a", []byte{0xc0})
	require.NoError(t, err)
	require.NoError(t, rollupAll(), "the node's grant lets it through")
	_, err = akv.Get(ctx, "n2.m.config.a")
	require.ErrorIs(t, err, jetstream.ErrKeyNotFound, "node n1 removed node n2's key")

	s, err := admin.js.Stream(ctx, provisioner.StreamName(provisioner.BucketNeeds))
	require.NoError(t, err)
	cfg := s.CachedInfo().Config
	cfg.AllowRollup = false
	_, err = admin.js.UpdateStream(ctx, cfg)
	require.NoError(t, err)
	_, err = akv.Put(ctx, "n2.m.config.a", []byte{0xc0})
	require.NoError(t, err)
	require.ErrorContains(t, rollupAll(), "rollup not permitted")
	require.ErrorContains(t, kv.Purge(ctx, "n1.m.config.x"), "rollup not permitted")
	_, err = kv.Put(ctx, "n1.m.config.y", []byte{0xc0})
	require.NoError(t, err)
	require.NoError(t, kv.Delete(ctx, "n1.m.config.y"))
	_, err = akv.Get(ctx, "n2.m.config.a")
	require.NoError(t, err, "node n2's key stays")
}
