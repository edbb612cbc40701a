{{/*
Names
*/}}
{{- define "redlock-sidecar.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" }}
{{- end }}

{{- define "redlock-sidecar.fullname" -}}
{{- if .Values.fullnameOverride }}
{{- .Values.fullnameOverride | trunc 63 | trimSuffix "-" }}
{{- else }}
{{- $name := default .Chart.Name .Values.nameOverride }}
{{- if contains $name .Release.Name }}
{{- .Release.Name | trunc 63 | trimSuffix "-" }}
{{- else }}
{{- printf "%s-%s" .Release.Name $name | trunc 63 | trimSuffix "-" }}
{{- end }}
{{- end }}
{{- end }}

{{/*
"<full name>-<suffix>", with the full name shortened so that the whole stays within `max` characters
(default 63, a DNS label). Takes a dict {root, suffix, max}. CronJobs and StatefulSets use 52: the
controller appends 11 characters to a CronJob's Job names, and a StatefulSet's name goes into its
pods' `controller-revision-hash` label value (name + 11).
*/}}
{{- define "redlock-sidecar.suffixedName" -}}
{{- $room := sub (int (default 63 .max)) (add 1 (len .suffix)) | int }}
{{- printf "%s-%s" (include "redlock-sidecar.fullname" .root | trunc $room | trimSuffix "-") .suffix }}
{{- end }}

{{- define "redlock-sidecar.chart" -}}
{{- printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/*
Labels. "redlock-sidecar.labels" takes a dict {root, component}; the component is optional.
*/}}
{{- define "redlock-sidecar.selectorLabels" -}}
app.kubernetes.io/name: {{ include "redlock-sidecar.name" .root }}
app.kubernetes.io/instance: {{ .root.Release.Name }}
{{- with .component }}
app.kubernetes.io/component: {{ . }}
{{- end }}
{{- end }}

{{- define "redlock-sidecar.labels" -}}
helm.sh/chart: {{ include "redlock-sidecar.chart" .root }}
{{ include "redlock-sidecar.selectorLabels" . }}
app.kubernetes.io/version: {{ .root.Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .root.Release.Service }}
app.kubernetes.io/part-of: redlock-sidecar
{{- end }}

{{/*
Labels of pod templates: no chart or app version, so that a chart upgrade that changes nothing
else in a pod does not restart it (above all the bundled Redis nodes, whose restart costs votes).
Takes a dict {root, component}.
*/}}
{{- define "redlock-sidecar.podLabels" -}}
{{ include "redlock-sidecar.selectorLabels" . }}
app.kubernetes.io/part-of: redlock-sidecar
{{- end }}

{{/*
The label every pod running this release's sidecar carries; PodMonitor and the metrics Service select it.
*/}}
{{- define "redlock-sidecar.sidecarLabel" -}}
redlock.io/sidecar: {{ include "redlock-sidecar.fullname" . }}
{{- end }}

{{/*
The ServiceAccount of the sidecar's pods. With the Kubernetes integration the Role (pod patch,
Event create) is bound to it, so it must never be the namespace's `default` account, which every
pod without its own account runs as.
*/}}
{{- define "redlock-sidecar.serviceAccountName" -}}
{{- $name := "" }}
{{- if .Values.serviceAccount.create }}
{{- $name = default (include "redlock-sidecar.fullname" .) .Values.serviceAccount.name }}
{{- else }}
{{- $name = default "default" .Values.serviceAccount.name }}
{{- end }}
{{- if and .Values.kubernetes.enabled (eq $name "default") }}
{{- fail "serviceAccount: the Role of the Kubernetes integration would be bound to the namespace's \"default\" ServiceAccount, which every pod without its own account uses; set serviceAccount.create=true or serviceAccount.name to a dedicated account" }}
{{- end }}
{{- $name }}
{{- end }}

{{/*
An image reference from {repository, tag, digest}: "repository:tag", or "repository:tag@digest".
*/}}
{{- define "redlock-sidecar.imageRef" -}}
{{- printf "%s:%s" .repository .tag }}{{ with .digest }}@{{ . }}{{ end }}
{{- end }}

{{- define "redlock-sidecar.guardServiceAccountName" -}}
{{- include "redlock-sidecar.suffixedName" (dict "root" . "suffix" "guard") }}
{{- end }}

{{- define "redlock-sidecar.image" -}}
{{- $repository := required "image.repository is required: this chart is the source tree's, which names no image; install a chart published by scripts/release.sh (it defaults to its image, by digest), or push an image for amd64 and arm64 (docs/kubernetes.md, \"The image\") and set image.repository (and image.digest)" .Values.image.repository }}
{{- include "redlock-sidecar.imageRef" (dict "repository" $repository "tag" (default .Chart.AppVersion .Values.image.tag) "digest" .Values.image.digest) }}
{{- end }}

{{/*
The lock's name: `lock.name`, else "<namespace>-<release>". Both parts are fixed for the life of a
release, so renaming objects (`fullnameOverride`, `nameOverride`) never renames the lock; a
rollout that renamed it would run one leader per name until it finished.
*/}}
{{- define "redlock-sidecar.lockName" -}}
{{- default (printf "%s-%s" .Release.Namespace .Release.Name) .Values.lock.name }}
{{- end }}

{{- define "redlock-sidecar.exampleName" -}}
{{- include "redlock-sidecar.suffixedName" (dict "root" . "suffix" "example") }}
{{- end }}

{{/*
Node affinity of every pod that runs the sidecar image or the guard binary copied from it:
`affinity`, with `kubernetes.io/arch In image.architectures` added to each of its required node
selector terms (terms are ORed, so every one needs it), or as the only term.
*/}}
{{- define "redlock-sidecar.affinity" -}}
{{- $affinity := deepCopy (.Values.affinity | default dict) }}
{{- with .Values.image.architectures }}
{{- $arch := dict "key" "kubernetes.io/arch" "operator" "In" "values" . }}
{{- $node := get $affinity "nodeAffinity" | default dict }}
{{- $required := get $node "requiredDuringSchedulingIgnoredDuringExecution" | default dict }}
{{- $terms := get $required "nodeSelectorTerms" | default (list dict) }}
{{- $withArch := list }}
{{- range $terms }}
{{- $term := deepCopy . }}
{{- $_ := set $term "matchExpressions" (append (get $term "matchExpressions" | default list) $arch) }}
{{- $withArch = append $withArch $term }}
{{- end }}
{{- $_ := set $required "nodeSelectorTerms" $withArch }}
{{- $_ := set $node "requiredDuringSchedulingIgnoredDuringExecution" $required }}
{{- $_ := set $affinity "nodeAffinity" $node }}
{{- end }}
{{- with $affinity }}
affinity:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- end }}

{{/*
The CronJob's name: `cronjob.name`, required (no default from the release): the Job names
<name>-<slot> are guard's schedule slot, so every cluster and release must use the same name.
*/}}
{{- define "redlock-sidecar.cronJobName" -}}
{{- required "cronjob.name is required with cronjob.enabled: guard's schedule slot is the Job name <cronjob.name>-<scheduled time> ($(JOB_NAME)), so every cluster and release running this job must use the same CronJob name, or each runs every slot; set e.g. cronjob.name=nightly-report" .Values.cronjob.name }}
{{- end }}

{{/*
The request locks' namespace on the nodes (`--locks-prefix`): `sidecar.locks.prefix`, else one per
app, derived from the lock name (the same in every cluster that shares the lock): the name itself
when it is 1 to 64 characters of A-Z a-z 0-9 . _ -, else its first 55 such characters (others
replaced by `_`), `-` and 8 hex digits of its sha256. A lock name never holds a `:` (schema), so
it never starts with "<prefix>:", which the sidecar refuses.
*/}}
{{- define "redlock-sidecar.locksPrefix" -}}
{{- if .Values.sidecar.locks.prefix }}
{{- .Values.sidecar.locks.prefix }}
{{- else }}
{{- $lock := include "redlock-sidecar.lockName" . }}
{{- if regexMatch "^[A-Za-z0-9._-]{1,64}$" $lock }}
{{- $lock }}
{{- else }}
{{- printf "%s-%s" (regexReplaceAll "[^A-Za-z0-9._-]" $lock "_" | trunc 55) (sha256sum $lock | trunc 8) }}
{{- end }}
{{- end }}
{{- end }}

{{/*
The label every pod that talks to Redis carries; the bundled Redis' NetworkPolicy admits only these.
*/}}
{{- define "redlock-sidecar.redisClientLabel" -}}
redlock.io/redis-client: {{ include "redlock-sidecar.fullname" . }}
{{- end }}

{{/*
The Secret holding the Redis password: `redis.existingSecret`, else the generated one when the chart
deploys Redis, else none (empty).
*/}}
{{- define "redlock-sidecar.redisSecret" -}}
{{- if .Values.redis.deploy.enabled }}
{{- required "redis.existingSecret is required with redis.deploy.enabled: the bundled Redis nodes always need a password, and a password generated while rendering would change on every render (GitOps) or sync. Create it once, e.g. kubectl create secret generic redlock-redis --from-literal=password=\"$(head -c 32 /dev/urandom | base64)\", and set redis.existingSecret=redlock-redis" .Values.redis.existingSecret }}
{{- else }}
{{- .Values.redis.existingSecret }}
{{- end }}
{{- end }}

{{/*
The shortest time in seconds between two runs of a cron schedule (a lower bound), for the deadline
checks; `cronjob.schedulePeriod` overrides it. Minute and hour fields are expanded (a star, steps,
single values, ranges with or without steps, lists); a single minute and hour give a day, or the shortest gap between the
listed weekdays; a day-of-month or month restriction counts as daily. Macros @hourly ... @yearly.
*/}}
{{- define "redlock-sidecar.cronFieldValues" -}}
{{- $lo := int .lo }}{{- $hi := int .hi }}
{{- $values := list }}
{{- range $part := splitList "," .field }}
{{- $step := 1 }}
{{- $range := $part }}
{{- if contains "/" $part }}
{{- $step = int (splitList "/" $part | last) }}
{{- $range = splitList "/" $part | first }}
{{- end }}
{{- $from := $lo }}{{- $to := $hi }}
{{- if ne $range "*" }}
{{- $from = int (splitList "-" $range | first) }}
{{- $to = ternary (int (splitList "-" $range | last)) $from (contains "-" $range) }}
{{- if and (contains "/" $part) (not (contains "-" $range)) }}{{ $to = $hi }}{{ end }}
{{- end }}
{{- if lt $step 1 }}{{ fail (printf "cronjob.schedule: step 0 in %q" $part) }}{{ end }}
{{- range $v := untilStep $from (add $to 1 | int) $step }}
{{- $values = append $values $v }}
{{- end }}
{{- end }}
{{- $values | uniq | sortAlpha | toJson }}
{{- end }}

{{- define "redlock-sidecar.cronMinGap" -}}
{{- $values := list }}
{{- range (include "redlock-sidecar.cronFieldValues" . | fromJsonArray) }}{{ $values = append $values (int .) }}{{ end }}
{{- $sorted := list }}
{{- range $v := until (int (add .hi 1)) }}{{ if has $v $values }}{{ $sorted = append $sorted $v }}{{ end }}{{ end }}
{{- $span := sub (add .hi 1) .lo | int }}
{{- if le (len $sorted) 1 }}
{{- $span }}
{{- else }}
{{- $gap := add $span (sub (first $sorted) (last $sorted)) | int }}
{{- range $i := until (sub (len $sorted) 1 | int) }}
{{- $gap = min $gap (sub (index $sorted (add $i 1)) (index $sorted $i)) | int }}
{{- end }}
{{- $gap }}
{{- end }}
{{- end }}

{{- define "redlock-sidecar.schedulePeriodSeconds" -}}
{{- $c := .Values.cronjob }}
{{- $macros := dict "@hourly" 3600 "@daily" 86400 "@midnight" 86400 "@weekly" 604800 "@monthly" 2419200 "@yearly" 2419200 "@annually" 2419200 }}
{{- $period := 0 }}
{{- if $c.schedulePeriod }}
{{- $period = include "redlock-sidecar.durationSeconds" $c.schedulePeriod | float64 | int }}
{{- else if hasKey $macros $c.schedule }}
{{- $period = get $macros $c.schedule | int }}
{{- else }}
{{- $f := regexSplit "\\s+" (trim $c.schedule) -1 }}
{{- if ne (len $f) 5 }}
{{- fail (printf "cronjob.schedule %q: expected five fields (or set cronjob.schedulePeriod)" $c.schedule) }}
{{- end }}
{{- range $f }}{{ if not (regexMatch "^(\\*|[0-9]+(-[0-9]+)?)(/[0-9]+)?(,[0-9]+(-[0-9]+)?(/[0-9]+)?)*$" .) }}
{{- fail (printf "cronjob.schedule %q: cannot derive its period from %q; set cronjob.schedulePeriod" $c.schedule .) }}
{{- end }}{{ end }}
{{- $minutes := include "redlock-sidecar.cronFieldValues" (dict "field" (index $f 0) "lo" 0 "hi" 59) | fromJsonArray }}
{{- $hours := include "redlock-sidecar.cronFieldValues" (dict "field" (index $f 1) "lo" 0 "hi" 23) | fromJsonArray }}
{{- if gt (len $minutes) 1 }}
{{- $period = mul 60 (include "redlock-sidecar.cronMinGap" (dict "field" (index $f 0) "lo" 0 "hi" 59)) | int }}
{{- else if gt (len $hours) 1 }}
{{- $period = mul 3600 (include "redlock-sidecar.cronMinGap" (dict "field" (index $f 1) "lo" 0 "hi" 23)) | int }}
{{- else if and (eq (index $f 2) "*") (eq (index $f 3) "*") (ne (index $f 4) "*") }}
{{- $period = mul 86400 (include "redlock-sidecar.cronMinGap" (dict "field" (index $f 4) "lo" 0 "hi" 6)) | int }}
{{- else }}
{{- $period = 86400 }}
{{- end }}
{{- end }}
{{- /* Daylight saving time shortens one day a year by an hour. */}}
{{- if and (ge $period 86400) (not (has $c.timeZone (list "UTC" "Etc/UTC" "Etc/GMT" "GMT"))) }}
{{- $period = sub $period 3600 }}
{{- end }}
{{- $period }}
{{- end }}

{{/*
A duration of the form <integer><ms|s|m|h> (the schema allows only that) in seconds, as a float.
*/}}
{{- define "redlock-sidecar.durationSeconds" -}}
{{- $n := regexFind "^[0-9]+" . | float64 }}
{{- $unit := regexReplaceAll "^[0-9]+" . "" }}
{{- $factor := get (dict "ms" 0.001 "s" 1.0 "m" 60.0 "h" 3600.0) $unit }}
{{- mulf $n $factor }}
{{- end }}

{{/*
A duration value in milliseconds (float), and milliseconds as text for messages.
*/}}
{{- define "redlock-sidecar.ms" -}}
{{- mulf (include "redlock-sidecar.durationSeconds" . | float64) 1000.0 }}
{{- end }}

{{- define "redlock-sidecar.fmtMs" -}}
{{- printf "%dms" (int (floor .)) }}
{{- end }}

{{/*
The lock's timing, derived and checked exactly as the binary does (src/config/ and the engine's
RedlockConfig::validate), so that a combination the sidecar would refuse with exit 2 (a CrashLoop
behind the native sidecar's startup gate) fails here, naming the value and the rule:
  drift    = ttl x 1% + 2ms
  ttl      >= 4 x (nodeTimeout + drift)
  interval = renewInterval, or ttl/3;  10ms <= interval < ttl/2
  floor    = nodeTimeout + drift;  room = ttl - interval - drift
  margin   = safetyMargin, or (floor < 1s: min(1s, midway), else midway), midway = floor + (room - floor)/2
  floor < margin < room
  shutdownTimeout > 2 x nodeTimeout
  maxTtl   = lock.maxTtl, or max(ttl, 60s);  maxTtl >= ttl;  maxDrift = maxTtl x 1% + 2ms
  ttl, maxTtl, renewInterval, safetyMargin, shutdownTimeout at most 1h; nodeTimeout, retryDelay at most 1m
Returns them as JSON (milliseconds). CI compares these verdicts with the binary's on a grid.
*/}}
{{- define "redlock-sidecar.timing" -}}
{{- $l := .Values.lock }}
{{- $fmt := "redlock-sidecar.fmtMs" }}
{{- /* The sidecar's upper bounds (src/redlock/timing.rs, src/config/): every deadline it computes
       stays far inside what its clocks can represent. */ -}}
{{- $bounds := list (list "lock.ttl" $l.ttl "1h" 3600000.0) (list "lock.maxTtl" $l.maxTtl "1h" 3600000.0) (list "lock.renewInterval" $l.renewInterval "1h" 3600000.0)
      (list "lock.safetyMargin" $l.safetyMargin "1h" 3600000.0) (list "lock.nodeTimeout" $l.nodeTimeout "1m" 60000.0)
      (list "lock.retryDelay" $l.retryDelay "1m" 60000.0) (list "sidecar.shutdownTimeout" .Values.sidecar.shutdownTimeout "1h" 3600000.0) }}
{{- range $bounds }}
{{- if and (index . 1) (gt (include "redlock-sidecar.ms" (index . 1) | float64) (index . 3)) }}
{{- fail (printf "%s (%s) must be at most %s" (index . 0) (index . 1) (index . 2)) }}
{{- end }}
{{- end }}
{{- $ttl := include "redlock-sidecar.ms" $l.ttl | float64 }}
{{- $maxTtl := include "redlock-sidecar.ms" (include "redlock-sidecar.maxTtl" .) | float64 }}
{{- if lt $maxTtl $ttl }}
{{- fail (printf "lock.maxTtl (%s) must be at least lock.ttl (%s): it is the longest ttl any sidecar of the lock uses (raise it before or with the ttl, docs/kubernetes.md \"Changing the ttl\")" $l.maxTtl $l.ttl) }}
{{- end }}
{{- $nt := include "redlock-sidecar.ms" $l.nodeTimeout | float64 }}
{{- $drift := addf (mulf $ttl 0.01) 2.0 }}
{{- if le $nt 0.0 }}
{{- fail "lock.nodeTimeout must be greater than 0" }}
{{- end }}
{{- if lt $ttl (mulf 4.0 (addf $nt $drift)) }}
{{- fail (printf "lock.ttl (%s) is too short: it must be at least 4 x (lock.nodeTimeout %s + drift %s), so that a round that uses the whole node timeout still leaves most of the ttl" $l.ttl $l.nodeTimeout (include $fmt $drift)) }}
{{- end }}
{{- $interval := divf $ttl 3.0 }}
{{- with $l.renewInterval }}
{{- $interval = include "redlock-sidecar.ms" . | float64 }}
{{- end }}
{{- if lt $interval 10.0 }}
{{- fail (printf "lock.renewInterval (%s) must be at least 10ms" (default (printf "ttl/3 = %s" (include $fmt $interval)) $l.renewInterval)) }}
{{- end }}
{{- if or (le $interval 0.0) (ge $interval (divf $ttl 2.0)) }}
{{- fail (printf "lock.renewInterval (%s) must be greater than 0 and less than ttl/2 (%s)" (default "ttl/3" $l.renewInterval) (include $fmt (divf $ttl 2.0))) }}
{{- end }}
{{- $floor := addf $nt $drift }}
{{- $room := maxf 0.0 (subf $ttl (addf $interval $drift)) }}
{{- $midway := addf $floor (divf (maxf 0.0 (subf $room $floor)) 2.0) }}
{{- $margin := ternary (minf 1000.0 $midway) $midway (lt $floor 1000.0) }}
{{- $marginText := printf "derived from lock.ttl: %s" (include $fmt $margin) }}
{{- with $l.safetyMargin }}
{{- $margin = include "redlock-sidecar.ms" . | float64 }}
{{- $marginText = . }}
{{- end }}
{{- if le $margin $floor }}
{{- fail (printf "lock.safetyMargin (%s) must exceed lock.nodeTimeout + drift (%s)" $marginText (include $fmt $floor)) }}
{{- end }}
{{- if ge $margin $room }}
{{- fail (printf "lock.safetyMargin (%s) must be less than ttl - renew interval - drift (%s), or no renewal can happen in time" $marginText (include $fmt $room)) }}
{{- end }}
{{- if le (include "redlock-sidecar.ms" .Values.sidecar.shutdownTimeout | float64) (mulf 2.0 $nt) }}
{{- fail (printf "sidecar.shutdownTimeout (%s) must exceed twice lock.nodeTimeout (%s): a release waits for a call still in flight on a node, then for its own answer" .Values.sidecar.shutdownTimeout $l.nodeTimeout) }}
{{- end }}
{{- dict "ttl" $ttl "maxTtl" $maxTtl "maxDrift" (addf (mulf $maxTtl 0.01) 2.0) "interval" $interval "margin" $margin "drift" $drift "nodeTimeout" $nt | toJson }}
{{- end }}

{{/*
The longest ttl any sidecar or guard of the lock uses (`--max-ttl`), as a duration: `lock.maxTtl`,
else max(lock.ttl, 60s). A restarted Redis node's votes count only once it has kept its data
that long (+ drift), so a contender with a shorter ttl never counts a node that lost a longer-ttl
holder's key: with the default, a rollout that changes the ttl anywhere up to 60s is safe without
setting anything. The price is the wait after a node restart (max-ttl + drift, not ttl + drift).
*/}}
{{- define "redlock-sidecar.maxTtl" -}}
{{- if .Values.lock.maxTtl }}
{{- .Values.lock.maxTtl }}
{{- else if ge (include "redlock-sidecar.ms" .Values.lock.ttl | float64) 60000.0 }}
{{- .Values.lock.ttl }}
{{- else }}
{{- "60s" }}
{{- end }}
{{- end }}

{{/*
How long a (re)started bundled Redis node stays NotReady, in whole seconds: until the sidecars
count its votes again. A node's grants count once it has provably kept its data for the longest
ttl + its drift (max-ttl: the sidecars are given `--max-ttl`), measured from the epoch marker the
first contender stamps after the restart (within one renew interval of the leader), and the leader
sees it counted at its next renewal: max-ttl + drift + 2 x renew interval, plus 1s because Redis
reports its uptime in whole seconds. `redis.deploy.readyAfterSeconds` overrides it (other clients
with a longer ttl).
*/}}
{{- define "redlock-sidecar.redisReadyAfterSeconds" -}}
{{- if not (kindIs "invalid" .Values.redis.deploy.readyAfterSeconds) }}
{{- .Values.redis.deploy.readyAfterSeconds }}
{{- else }}
{{- $t := include "redlock-sidecar.timing" . | fromJson }}
{{- add (int (ceil (divf (addf $t.maxTtl $t.maxDrift (mulf 2.0 $t.interval)) 1000.0))) 1 }}
{{- end }}
{{- end }}

{{/*
Checks of combinations the schema cannot express. Included once from every template that renders pods.
*/}}
{{- define "redlock-sidecar.validate" -}}
{{- $_ := include "redlock-sidecar.timing" . }}
{{- if and (not .Values.redis.deploy.enabled) .Values.redis.urls (eq (mod (len .Values.redis.urls) 2) 0) }}
{{- fail (printf "redis.urls lists %d nodes: use an odd number (3 or 5). A lock needs a majority, and with an even number one more node buys no extra failure tolerance (2 of 2: any one node down stops the lock)" (len .Values.redis.urls)) }}
{{- end }}
{{- if and .Values.kubernetes.admissionPolicy.enabled (not .Values.kubernetes.enabled) }}
{{- fail "kubernetes.admissionPolicy.enabled limits the sidecar's pod patches, which needs kubernetes.enabled=true" }}
{{- end }}
{{- $shutdown := include "redlock-sidecar.durationSeconds" .Values.sidecar.shutdownTimeout | float64 }}
{{- if ge $shutdown (float64 .Values.terminationGracePeriodSeconds) }}
{{- fail (printf "sidecar.shutdownTimeout (%s) must be shorter than terminationGracePeriodSeconds (%d): the kubelet would kill the sidecar before it releases the lock" .Values.sidecar.shutdownTimeout (int .Values.terminationGracePeriodSeconds)) }}
{{- end }}
{{- if and .Values.redis.deploy.enabled .Values.redis.urls }}
{{- fail "set either redis.urls (external Redis masters) or redis.deploy.enabled=true (deploy them with this chart), not both" }}
{{- end }}
{{- if not (or .Values.redis.deploy.enabled .Values.redis.urls) }}
{{- fail "no Redis nodes: set redis.urls to your Redis masters, or redis.deploy.enabled=true" }}
{{- end }}
{{- if and .Values.redis.deploy.enabled .Values.redis.tls.enabled }}
{{- fail "redis.tls.enabled needs external Redis nodes (redis.urls); the Redis nodes deployed by this chart do not serve TLS" }}
{{- end }}
{{- if and .Values.example.enabled .Values.example.service.enabled (not .Values.kubernetes.enabled) }}
{{- fail "example.service routes by the leader pod label, which needs kubernetes.enabled=true" }}
{{- end }}
{{- if and .Values.redis.sentinel.existingSecret (not (include "redlock-sidecar.sentinelUrls" .)) }}
{{- fail "redis.sentinel.existingSecret is the Sentinels' password, but no redis.urls entry is a Sentinel group (redis+sentinel://...)" }}
{{- end }}
{{- if and .Values.redis.deploy.enabled (eq .Values.redis.deploy.extraPasswordKey .Values.redis.passwordKey) }}
{{- fail (printf "redis.deploy.extraPasswordKey must differ from redis.passwordKey (both are %q)" .Values.redis.passwordKey) }}
{{- end }}
{{- if and .Values.redis.tls.caSecret .Values.redis.tls.caConfigMap }}
{{- fail "set either redis.tls.caSecret or redis.tls.caConfigMap, not both" }}
{{- end }}
{{- if and .Values.kubernetes.enabled .Values.kubernetes.mirrorLease }}
{{- $lock := include "redlock-sidecar.lockName" . }}
{{- if not (and (regexMatch "^[a-z0-9]([-a-z0-9]*[a-z0-9])?$" $lock) (le (len $lock) 55)) }}
{{- fail (printf "kubernetes.mirrorLease: the lock name %q must be a DNS label of at most 55 characters (the Lease is redlock-<lock>, and the Role grants exactly that name); set lock.name" $lock) }}
{{- end }}
{{- end }}
{{- if .Values.cronjob.enabled }}
{{- include "redlock-sidecar.validateCronJob" . }}
{{- end }}
{{- include "redlock-sidecar.validatePlatform" . }}
{{- end }}

{{/*
The platform review's combinations (one line each, naming the values).
*/}}
{{- define "redlock-sidecar.validatePlatform" -}}
{{- if and .Values.redis.deploy.enabled .Values.redis.username }}
{{- fail (printf "redis.username (%q) is not a user of the bundled Redis (redis.deploy.enabled): its nodes know only the default user, with the password of redis.existingSecret, so every AUTH as %q would fail; leave redis.username empty, or give your own nodes in redis.urls" .Values.redis.username .Values.redis.username) }}
{{- end }}
{{- $m := .Values.monitoring }}
{{- if and $m.prometheusRule.enabled (eq $m.prometheusRule.scope "namespace") (eq $m.scrape "release") }}
{{- fail "monitoring.prometheusRule.scope=namespace alerts on every lock of the namespace, but monitoring.scrape=release scrapes only this release's pods, so attached locks would be alerted on and never scraped: set monitoring.scrape=namespace (with monitoring.podMonitor.enabled, or without a monitor where another release's PodMonitor scrapes the namespace), or monitoring.prometheusRule.scope=release" }}
{{- end }}
{{- $fullname := include "redlock-sidecar.fullname" . }}
{{- if hasPrefix "redlock-sidecar-attach" $fullname }}
{{- fail (printf "the full name %q (release name or fullnameOverride) starts with \"redlock-sidecar-attach\", the names of the kustomize Components' Roles and RoleBindings (manifests/attach); choose another release name or fullnameOverride" $fullname) }}
{{- end }}
{{- end }}

{{/*
The CronJob's values: the same lock name and time zone in every cluster, and deadlines that fit the schedule.
*/}}
{{- define "redlock-sidecar.validateCronJob" -}}
{{- $c := .Values.cronjob }}
{{- if not $c.timeZone }}
{{- fail "cronjob.timeZone is required (e.g. Etc/UTC): every cluster running this job must use the same time zone, or their schedule slots differ" }}
{{- end }}
{{- if not (has $c.timeZone (.Files.Get "files/time-zones.txt" | splitList "\n")) }}
{{- fail (printf "cronjob.timeZone %q is not an IANA time zone name (e.g. Etc/UTC, Europe/Berlin; the list is files/time-zones.txt of the chart)" $c.timeZone) }}
{{- end }}
{{- if not $c.lockName }}
{{- fail "cronjob.lockName is required: every cluster running this job must use the same lock name, so it is not derived from the release" }}
{{- end }}
{{- $_ := include "redlock-sidecar.cronJobName" . }}
{{- if and (not .Values.kubernetes.enabled) $c.guard.events }}
{{- fail "cronjob.guard.events records Events through the Kubernetes API, which needs kubernetes.enabled=true (or set cronjob.guard.events=false)" }}
{{- end }}
{{- $period := include "redlock-sidecar.schedulePeriodSeconds" . | int }}
{{- $deadline := int $c.activeDeadlineSeconds }}
{{- $start := int $c.startingDeadlineSeconds }}
{{- if gt (add $start $deadline) $period }}
{{- fail (printf "cronjob: startingDeadlineSeconds (%d) + activeDeadlineSeconds (%d) must not exceed the schedule's period (%ds, %q in %s): a run could still be going when the next slot starts" $start $deadline $period $c.schedule $c.timeZone) }}
{{- end }}
{{- with $c.guard.minHold }}
{{- $minHold := include "redlock-sidecar.durationSeconds" . | float64 }}
{{- if ge $minHold (float64 $period) }}
{{- fail (printf "cronjob.guard.minHold (%s) must be shorter than the schedule's period (%ds): the next slot would find the lock still held" . $period) }}
{{- end }}
{{- if ge $minHold (float64 $deadline) }}
{{- fail (printf "cronjob.guard.minHold (%s) must be shorter than activeDeadlineSeconds (%d): guard holds the lock, and its pod runs, that long" . $deadline) }}
{{- end }}
{{- end }}
{{- with $c.guard.maxHold }}
{{- if ge (include "redlock-sidecar.durationSeconds" . | float64) (float64 $deadline) }}
{{- fail (printf "cronjob.guard.maxHold (%s) must be shorter than activeDeadlineSeconds (%d), so guard stops the command and releases the lock before Kubernetes kills the pod" . $deadline) }}
{{- end }}
{{- end }}
{{- if $c.lockPerScheduleSlot }}
{{- if or (not $c.guard.minHold) (lt (include "redlock-sidecar.durationSeconds" (default "0s" $c.guard.minHold) | float64) (float64 $start)) }}
{{- fail (printf "cronjob.lockPerScheduleSlot needs cronjob.guard.minHold of at least startingDeadlineSeconds (%ds): another cluster may start the same slot that much later, and must still find the lock held" $start) }}
{{- end }}
{{- end }}
{{- end }}

{{/*
checkov findings this chart does not follow on purpose, as annotations of the workload object
(checkov reads `checkov.io/skipN: CHECK=reason`). Takes a dict {digests}: whether every image of
the workload is pinned by digest.
*/}}
{{- define "redlock-sidecar.checkovSkips" -}}
# CPU limits make the kernel throttle the lock loop and Redis, which delays renewals past the
# safety margin and loses the lock; CPU requests reserve what they need instead.
checkov.io/skip1: CKV_K8S_11=CPU limits would throttle lock renewals; CPU requests are set
# Tags are pinned (never latest) and digests are values; Always would only add a registry
# round trip, and a registry outage, to every container restart. pullPolicy is a value.
checkov.io/skip2: CKV_K8S_15=pinned tags or digests; pull policy is configurable
{{- if not .digests }}
# Pull by digest by setting the images' `digest` values; the sidecar image is built by each
# user, so the chart cannot ship its digest.
checkov.io/skip3: CKV_K8S_43=set the digest values to pull by digest
{{- end }}
{{- end }}

{{/*
Redis nodes
*/}}
{{/*
The bundled Redis StatefulSet and its governing Service (52 characters: the StatefulSet's name
goes into its pods' controller-revision-hash label, name + 11).
*/}}
{{/*
The number of redis.urls that are Sentinel groups (empty when none), for the checks and NOTES.
*/}}
{{- define "redlock-sidecar.sentinelUrls" -}}
{{- $n := 0 }}
{{- range .Values.redis.urls }}{{ if regexMatch "^rediss?\\+sentinel://" . }}{{ $n = add1 $n }}{{ end }}{{ end }}
{{- if $n }}{{ $n }}{{ end }}
{{- end }}

{{- define "redlock-sidecar.redisName" -}}
{{- include "redlock-sidecar.suffixedName" (dict "root" . "suffix" "redis" "max" 52) }}
{{- end }}

{{- define "redlock-sidecar.redisUrls" -}}
{{- $urls := list }}
{{- if .Values.redis.deploy.enabled }}
{{- $name := include "redlock-sidecar.redisName" . }}
{{- range $i := until (int .Values.redis.deploy.nodes) }}
{{- $urls = append $urls (printf "redis://%s-%d.%s.%s.svc:%d" $name $i $name $.Release.Namespace (int $.Values.redis.deploy.port)) }}
{{- end }}
{{- else }}
{{- range .Values.redis.urls }}
{{- $urls = append $urls (ternary (regexReplaceAll "^redis(\\+sentinel)?://" . "rediss${1}://") . $.Values.redis.tls.enabled) }}
{{- end }}
{{- end }}
{{- join "," $urls }}
{{- end }}

{{/*
The TCP ports of the Redis nodes, comma-separated (for the service-mesh exclusion annotations).
*/}}
{{- define "redlock-sidecar.redisPorts" -}}
{{- $ports := list }}
{{- if .Values.redis.deploy.enabled }}
{{- $ports = list (toString .Values.redis.deploy.port) }}
{{- else }}
{{- range .Values.redis.urls }}
{{- $port := regexFind "[0-9]+$" (regexFind ":[0-9]+$" (urlParse .).host) | default "6379" }}
{{- $ports = append $ports $port }}
{{- end }}
{{- end }}
{{- $ports | uniq | sortAlpha | join "," }}
{{- end }}

{{/*
Annotations of every pod that runs the sidecar or guard: `podAnnotations`, and with
`serviceMesh.excludeRedisPorts` the Istio and Linkerd annotations that send Redis traffic around
the mesh proxy, so that the lock's release at shutdown does not depend on the proxy outliving
the sidecar.
*/}}
{{- define "redlock-sidecar.podAnnotations" -}}
{{- $annotations := deepCopy (.Values.podAnnotations | default dict) }}
{{- if .Values.serviceMesh.excludeRedisPorts }}
{{- $ports := include "redlock-sidecar.redisPorts" . }}
{{- $_ := set $annotations "traffic.sidecar.istio.io/excludeOutboundPorts" $ports }}
{{- $_ := set $annotations "config.linkerd.io/skip-outbound-ports" $ports }}
{{- end }}
{{- with $annotations }}
annotations:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- end }}

{{/*
Environment shared by `run` and `guard`: pod identity, Redis nodes and credentials, lock timings.
*/}}
{{- define "redlock-sidecar.commonEnv" -}}
- name: POD_NAME
  valueFrom:
    fieldRef:
      fieldPath: metadata.name
- name: POD_NAMESPACE
  valueFrom:
    fieldRef:
      fieldPath: metadata.namespace
- name: POD_UID
  valueFrom:
    fieldRef:
      fieldPath: metadata.uid
- name: REDLOCK_REDIS
  value: {{ include "redlock-sidecar.redisUrls" . | quote }}
{{- with .Values.redis.username }}
- name: REDLOCK_REDIS_USERNAME
  value: {{ . | quote }}
{{- end }}
{{- if (include "redlock-sidecar.redisSecret" .) }}
- name: REDLOCK_REDIS_PASSWORD_FILE
  value: /etc/redlock/redis-auth/{{ .Values.redis.passwordKey }}
{{- end }}
{{- with .Values.redis.sentinel.username }}
- name: REDLOCK_SENTINEL_USERNAME
  value: {{ . | quote }}
{{- end }}
{{- if .Values.redis.sentinel.existingSecret }}
- name: REDLOCK_SENTINEL_PASSWORD_FILE
  value: /etc/redlock/sentinel-auth/{{ .Values.redis.sentinel.passwordKey }}
{{- end }}
{{- if or .Values.redis.tls.caSecret .Values.redis.tls.caConfigMap }}
- name: REDLOCK_REDIS_CA_FILE
  value: /etc/redlock/redis-ca/{{ .Values.redis.tls.caKey }}
{{- end }}
{{- if .Values.redis.tls.clientCertSecret }}
- name: REDLOCK_REDIS_CLIENT_CERT
  value: /etc/redlock/redis-client/{{ .Values.redis.tls.clientCertKey }}
- name: REDLOCK_REDIS_CLIENT_KEY
  value: /etc/redlock/redis-client/{{ .Values.redis.tls.clientKeyKey }}
{{- end }}
- name: REDLOCK_TTL
  value: {{ .Values.lock.ttl | quote }}
# The longest ttl any contender of the lock uses, always given: a contender with a shorter ttl
# then never counts a Redis node that restarted too recently for a longer-ttl holder's key.
- name: REDLOCK_MAX_TTL
  value: {{ include "redlock-sidecar.maxTtl" . | quote }}
{{- with .Values.lock.renewInterval }}
- name: REDLOCK_RENEW_INTERVAL
  value: {{ . | quote }}
{{- end }}
{{- with .Values.lock.safetyMargin }}
- name: REDLOCK_SAFETY_MARGIN
  value: {{ . | quote }}
{{- end }}
- name: REDLOCK_NODE_TIMEOUT
  value: {{ .Values.lock.nodeTimeout | quote }}
- name: REDLOCK_RETRY_DELAY
  value: {{ .Values.lock.retryDelay | quote }}
- name: REDLOCK_LOG_FORMAT
  value: {{ .Values.sidecar.logFormat | quote }}
{{- end }}

{{/*
Mounts and volumes of the Redis password file and TLS files (CA, client certificate and key), for
every container that connects to Redis. Files, not environment variables: a rotated Secret is
read again by every new connection, and guard's CMD, which runs as the same user, could read
guard's environment from /proc.
*/}}
{{- define "redlock-sidecar.redisClientVolumeMounts" -}}
{{- if (include "redlock-sidecar.redisSecret" .) }}
- name: redis-auth
  mountPath: /etc/redlock/redis-auth
  readOnly: true
{{- end }}
{{- if .Values.redis.sentinel.existingSecret }}
- name: sentinel-auth
  mountPath: /etc/redlock/sentinel-auth
  readOnly: true
{{- end }}
{{- if or .Values.redis.tls.caSecret .Values.redis.tls.caConfigMap }}
- name: redis-ca
  mountPath: /etc/redlock/redis-ca
  readOnly: true
{{- end }}
{{- if .Values.redis.tls.clientCertSecret }}
- name: redis-client-cert
  mountPath: /etc/redlock/redis-client
  readOnly: true
{{- end }}
{{- end }}

{{- define "redlock-sidecar.redisClientVolumes" -}}
{{- with (include "redlock-sidecar.redisSecret" .) }}
- name: redis-auth
  secret:
    secretName: {{ . }}
    defaultMode: 0440
    items:
      - key: {{ $.Values.redis.passwordKey }}
        path: {{ $.Values.redis.passwordKey }}
{{- end }}
{{- with .Values.redis.sentinel.existingSecret }}
- name: sentinel-auth
  secret:
    secretName: {{ . }}
    defaultMode: 0440
    items:
      - key: {{ $.Values.redis.sentinel.passwordKey }}
        path: {{ $.Values.redis.sentinel.passwordKey }}
{{- end }}
{{- with .Values.redis.tls.caSecret }}
- name: redis-ca
  secret:
    secretName: {{ . }}
{{- end }}
{{- with .Values.redis.tls.caConfigMap }}
- name: redis-ca
  configMap:
    name: {{ . }}
{{- end }}
{{- with .Values.redis.tls.clientCertSecret }}
- name: redis-client-cert
  secret:
    secretName: {{ . }}
    defaultMode: 0440
{{- end }}
{{- end }}

{{/*
The service-account token, as the kubelet's own kube-api-access volume, but mounted only into the
container that calls the API (the pod sets automountServiceAccountToken: false).
*/}}
{{- define "redlock-sidecar.apiTokenVolume" -}}
- name: kube-api-access
  projected:
    defaultMode: 0444
    sources:
      - serviceAccountToken:
          path: token
          expirationSeconds: 3607
      - configMap:
          name: kube-root-ca.crt
          items:
            - key: ca.crt
              path: ca.crt
      - downwardAPI:
          items:
            - path: namespace
              fieldRef:
                apiVersion: v1
                fieldPath: metadata.namespace
{{- end }}

{{- define "redlock-sidecar.apiTokenVolumeMount" -}}
- name: kube-api-access
  mountPath: /var/run/secrets/kubernetes.io/serviceaccount
  readOnly: true
{{- end }}

{{/*
Scheduling of the example Deployment's and CronJob's pods: node selector, tolerations, affinity,
priority. Takes the root context.
*/}}
{{- define "redlock-sidecar.scheduling" -}}
{{- with .Values.nodeSelector }}
nodeSelector:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- with .Values.tolerations }}
tolerations:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- include "redlock-sidecar.affinity" . }}
{{- with .Values.priorityClassName }}
priorityClassName: {{ . }}
{{- end }}
{{- end }}

{{/*
Pod-level settings of every pod that runs the sidecar or guard. Takes a dict {root, serviceAccount}.
No container gets a token automatically; the one that calls the API mounts kube-api-access.
*/}}
{{- define "redlock-sidecar.podSettings" -}}
serviceAccountName: {{ .serviceAccount }}
automountServiceAccountToken: false
enableServiceLinks: false
terminationGracePeriodSeconds: {{ .root.Values.terminationGracePeriodSeconds }}
{{- include "redlock-sidecar.scheduling" .root }}
securityContext:
  {{- toYaml .root.Values.podSecurityContext | nindent 2 }}
{{- with .root.Values.imagePullSecrets }}
imagePullSecrets:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- end }}

{{/*
The sidecar container (`redlock-sidecar run`). As a native sidecar it goes into initContainers.
*/}}
{{- define "redlock-sidecar.container" -}}
- name: redlock-sidecar
  image: {{ include "redlock-sidecar.image" . }}
  imagePullPolicy: {{ .Values.image.pullPolicy }}
  {{- if .Values.sidecar.native }}
  restartPolicy: Always
  {{- end }}
  args: ["run"]
  env:
    {{- include "redlock-sidecar.commonEnv" . | nindent 4 }}
    - name: REDLOCK_LOCK
      value: {{ include "redlock-sidecar.lockName" . | quote }}
    - name: REDLOCK_LISTEN
      value: {{ printf "0.0.0.0:%d" (int .Values.sidecar.port) | quote }}
    # Loopback only: the app containers of the pod reach it, nothing outside the pod does.
    - name: REDLOCK_CONTROL_LISTEN
      value: {{ printf "127.0.0.1:%d" (int .Values.sidecar.controlPort) | quote }}
    - name: REDLOCK_LOCKS
      value: {{ ternary "on" "off" .Values.sidecar.locks.enabled | quote }}
    {{- if .Values.sidecar.locks.enabled }}
    # One namespace of request locks per app (sidecar.locks.prefix): two apps on the same nodes
    # never block each other's request locks.
    - name: REDLOCK_LOCKS_PREFIX
      value: {{ include "redlock-sidecar.locksPrefix" . | quote }}
    - name: REDLOCK_LOCKS_MAX_LEASES
      value: {{ .Values.sidecar.locks.maxLeases | quote }}
    - name: REDLOCK_LOCKS_DAPR_STORE
      value: {{ .Values.sidecar.locks.daprStore | quote }}
    {{- end }}
    {{- with .Values.sidecar.shards }}
    # The pods of the lock split this many shards (sidecar.shards); the app reads GET /v1/shards.
    - name: REDLOCK_SHARDS
      value: {{ int . | quote }}
    {{- end }}
    - name: REDLOCK_READY_WHEN
      value: {{ .Values.sidecar.readyWhen | quote }}
    - name: REDLOCK_SHUTDOWN_TIMEOUT
      value: {{ .Values.sidecar.shutdownTimeout | quote }}
    - name: REDLOCK_KUBERNETES
      value: {{ ternary "on" "off" .Values.kubernetes.enabled | quote }}
    - name: REDLOCK_LEADER_LABEL
      value: {{ .Values.kubernetes.leaderLabel | quote }}
    - name: REDLOCK_MIRROR_LEASE
      value: {{ and .Values.kubernetes.enabled .Values.kubernetes.mirrorLease | quote }}
    # Exported as redlock_info{workload}: the alert RedlockLeadersAcrossLocks sees two locks
    # led at once in one workload (a rollout that renamed the lock).
    - name: REDLOCK_WORKLOAD
      value: {{ include "redlock-sidecar.exampleName" . | quote }}
    {{- if .Values.kubernetes.enabled }}
    {{- with .Values.sidecar.followContainer }}
    {{- if and (eq . "*") (not $.Values.sidecar.native) $.Values.sidecar.readinessProbe (eq $.Values.sidecar.readyWhen "leader") }}
    {{- fail "sidecar.followContainer \"*\" with a regular (not native) sidecar container whose readiness is leadership would wait for itself: name the app container instead" }}
    {{- end }}
    # Contend only while the app containers are ready (their own readinessProbes decide).
    - name: REDLOCK_FOLLOW_CONTAINER
      value: {{ . | quote }}
    {{- end }}
    {{- end }}
    {{- with .Values.sidecar.extraEnv }}
    {{- toYaml . | nindent 4 }}
    {{- end }}
  ports:
    - name: admin
      containerPort: {{ .Values.sidecar.port }}
      protocol: TCP
  # /healthz answers once the lock loop runs, whatever Redis does. As a native sidecar, the app
  # containers start only after this probe passed, so their first GET /leader finds the sidecar.
  startupProbe:
    httpGet:
      path: /healthz
      port: admin
    periodSeconds: 1
    timeoutSeconds: 2
    failureThreshold: 30
  livenessProbe:
    httpGet:
      path: /healthz
      port: admin
    periodSeconds: 10
    timeoutSeconds: 2
    failureThreshold: 3
  {{- if .Values.sidecar.readinessProbe }}
  # Opted in (sidecar.readinessProbe): the pod is NotReady while /readyz fails.
  readinessProbe:
    httpGet:
      path: /readyz
      port: admin
    periodSeconds: 5
    timeoutSeconds: 2
    failureThreshold: 2
  {{- end }}
  resources:
    {{- toYaml .Values.sidecar.resources | nindent 4 }}
  securityContext:
    {{- toYaml .Values.securityContext | nindent 4 }}
  {{- $mounts := include "redlock-sidecar.redisClientVolumeMounts" . }}
  {{- if .Values.kubernetes.enabled }}
  {{- $mounts = printf "%s\n%s" $mounts (include "redlock-sidecar.apiTokenVolumeMount" .) }}
  {{- end }}
  {{- with trim $mounts }}
  volumeMounts:
    {{- . | nindent 4 }}
  {{- end }}
{{- end }}
