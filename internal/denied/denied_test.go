package denied_test

import (
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/novox/mesh-provisioner/internal/denied"
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
