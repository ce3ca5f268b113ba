package denied_test

import (
	"context"
	"errors"
	"fmt"
	"sync"
	"testing"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/stretchr/testify/require"

	"github.com/novox/mesh-provisioner/internal/denied"
	"github.com/novox/mesh-provisioner/internal/natstest"
)

func TestOfStream(t *testing.T) {
	of := denied.OfStream("KV_composed-n1")
	for subject, want := range map[string]bool{
		"$JS.API.CONSUMER.CREATE.KV_composed-n1.abc":                       true,
		"$JS.API.CONSUMER.CREATE.KV_composed-n1.abc.$KV.composed-n1.>":     true,
		"$JS.API.STREAM.INFO.KV_composed-n1":                               true,
		"$JS.hub.API.CONSUMER.MSG.NEXT.KV_composed-n1.abc":                 true,
		"$JS.API.DIRECT.GET.KV_composed-n1.$KV.composed-n1.web.1":          true,
		"$KV.composed-n1.web.1":                                            true,
		"$JS.API.CONSUMER.CREATE.KV_composed-n10.abc":                      false, // a token, not a prefix
		"$KV.composed-n10.web.1":                                           false,
		"$JS.API.STREAM.LIST":                                              false,
		"mesh-provisioner.provisioning":                                    false,
		"$JS.API.DIRECT.GET.KV_mesh-provisioner_needs.$KV.composed-n1.x.y": false,
	} {
		require.Equal(t, want, of(subject), subject)
	}
}

// TestContext_EveryViolationCounts: two requests refused at once, on one connection whose owner logs
// its errors. nats.go keeps only the last error: the request refused first found the other's there
// and waited out its timeout. Each ends with its own refusal at once; the owner's callback still hears
// both; a request not refused goes on.
func TestContext_EveryViolationCounts(t *testing.T) {
	ns := natstest.RunServerSeatDenied(t, "$KV.a.>", "$KV.b.>")
	var mu sync.Mutex
	var owner []string
	nc, _ := natstest.Connect(t, ns.ClientURL(), nats.UserInfo("seat", "seat"), nats.ErrorHandler(func(_ *nats.Conn, _ *nats.Subscription, err error) {
		mu.Lock()
		defer mu.Unlock()
		owner = append(owner, err.Error())
	}))
	ctxA, stopA := denied.Context(context.Background(), nc, denied.OfStream("KV_a"))
	defer stopA()
	ctxB, stopB := denied.Context(context.Background(), nc, denied.OfStream("KV_b"))
	defer stopB()
	ctxC, stopC := denied.Context(context.Background(), nc, denied.OfStream("KV_c"))
	defer stopC()
	mark := denied.Mark(nc)
	require.NoError(t, nc.Publish("$KV.a.x", nil))
	require.NoError(t, nc.Publish("$KV.b.x", nil))
	require.NoError(t, nc.Flush())
	for name, c := range map[string]struct {
		ctx   context.Context
		grant string
	}{"a": {ctxA, "$KV.a.>"}, "b": {ctxB, "$KV.b.>"}} {
		select {
		case <-c.ctx.Done():
		case <-time.After(30 * time.Second):
			t.Fatalf("%s: not ended by its refusal", name)
		}
		var de *denied.Error
		require.True(t, errors.As(context.Cause(c.ctx), &de), name)
		require.Equal(t, c.grant, denied.Grant(de.Subject), name)
		v := denied.Since(nc, mark, denied.OfStream("KV_"+name))
		require.NotNil(t, v, name)
		require.Equal(t, c.grant, denied.Grant(v.Subject), name)
	}
	require.NoError(t, ctxC.Err(), "a request not refused goes on")
	natstest.CheckFor(t, 30*time.Second, 10*time.Millisecond, func() error {
		mu.Lock()
		defer mu.Unlock()
		if len(owner) != 2 {
			return fmt.Errorf("the owner's callback heard %q", owner)
		}
		return nil
	})
	require.Nil(t, denied.Since(nc, denied.Mark(nc), denied.OfStream("KV_a")), "nothing since the last mark")
}

// TestSubscriptionSince_AnotherRefusalAfter: a subscription refused, then another request of the same
// connection refused before the flush that confirms the subscription returns (serve's projector
// setting up a node's bucket the seat may not read, while the verb subscribes). The connection's last
// error is the other's: serve took the verb's subscription for granted, said "answering" and ready,
// and no request reached it. The refusal is found all the same.
func TestSubscriptionSince_AnotherRefusalAfter(t *testing.T) {
	ns := natstest.RunServerSeatRefused(t, []string{"$KV.a.>"}, []string{"verb"})
	nc, _ := natstest.Connect(t, ns.ClientURL(), nats.UserInfo("seat", "seat"), nats.ErrorHandler(func(*nats.Conn, *nats.Subscription, error) {}))
	mark := denied.Mark(nc)
	_, err := nc.Subscribe("verb", func(*nats.Msg) {})
	require.NoError(t, err)
	require.NoError(t, nc.Publish("$KV.a.x", nil))
	require.NoError(t, nc.Flush())
	require.Contains(t, nc.LastError().Error(), `Publish to "$KV.a.x"`, "the last error is the other refusal")
	v := denied.SubscriptionSince(nc, mark, "verb", 30*time.Second)
	require.NotNil(t, v, "the subscription's refusal is found")
	require.Equal(t, "subscribe", v.Op)
	require.Equal(t, "verb", v.Subject)
	require.Nil(t, denied.SubscriptionSince(nc, denied.Mark(nc), "verb", 30*time.Second), "not after a later mark")

	// Granted: no refusal, and no wait past the callback's hearing the last error.
	nc2, _ := natstest.Connect(t, ns.ClientURL(), nats.UserInfo("seat", "seat"), nats.ErrorHandler(func(*nats.Conn, *nats.Subscription, error) {}))
	mark = denied.Mark(nc2)
	_, err = nc2.Subscribe("other", func(*nats.Msg) {})
	require.NoError(t, err)
	require.NoError(t, nc2.Publish("$KV.a.x", nil))
	require.NoError(t, nc2.Flush())
	require.Nil(t, denied.SubscriptionSince(nc2, mark, "other", 30*time.Second))
}
