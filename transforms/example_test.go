package transforms_test

import (
	"fmt"
	"io"
	"net/http"
	"strings"

	"github.com/sandgate/sandgate/transforms"
)

func Example() {
	env := map[string]string{"ANTHROPIC_API_KEY": "sk-ant-api03-real-key"}
	rules, err := transforms.ParseRules([]byte(`[{
	  "match": {"host": "api.anthropic.com", "path": {"startsWith": "/v1/"}, "method": ["POST"]},
	  "transform": {"headers": {"x-api-key": {"env": "ANTHROPIC_API_KEY"}}}
	}]`), func(k string) (string, bool) { v, ok := env[k]; return v, ok })
	if err != nil {
		fmt.Println(err)
		return
	}
	set := transforms.NewRuleSet(rules...)

	// The sandbox sent its placeholder; the proxy builds the outbound request.
	out, _ := http.NewRequest("POST", "https://api.anthropic.com/v1/messages", nil)
	out.Header.Set("X-Api-Key", "sandgate-placeholder-ANTHROPIC_API_KEY")
	applied := set.Apply(out)
	fmt.Println(applied.Rules, applied.Secrets)
	fmt.Println(out.Header.Get("X-Api-Key") == env["ANTHROPIC_API_KEY"])

	// The upstream echoes the key; the sandbox gets the placeholder back.
	resp := &http.Response{
		Header: http.Header{"Content-Type": {"text/event-stream"}},
		Body:   io.NopCloser(strings.NewReader("data: you sent sk-ant-api03-real-key\n\n")),
	}
	if err := applied.ScrubResponse(resp); err != nil {
		fmt.Println(err) // the proxy answers 502
		return
	}
	body, _ := io.ReadAll(resp.Body)
	fmt.Printf("%q\n", body)
	// Output:
	// [rule[0] api.anthropic.com] [[REDACTED]]
	// true
	// "data: you sent sandgate-placeholder-ANTHROPIC_API_KEY\n\n"
}

func ExampleNewScrubReader() {
	secret, _ := transforms.NewSecret("TOKEN", "tok_0123456789", "<TOKEN>")
	r := transforms.NewScrubReader(strings.NewReader("a tok_0123456789 b"), []*transforms.Secret{secret})
	out, _ := io.ReadAll(r)
	fmt.Printf("%s %v\n", out, secret)
	// Output: a <TOKEN> b [REDACTED]
}
