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
The label every pod running this release's sidecar carries; PodMonitor and the metrics Service select it.
*/}}
{{- define "redlock-sidecar.sidecarLabel" -}}
redlock.io/sidecar: {{ include "redlock-sidecar.fullname" . }}
{{- end }}

{{- define "redlock-sidecar.serviceAccountName" -}}
{{- if .Values.serviceAccount.create }}
{{- default (include "redlock-sidecar.fullname" .) .Values.serviceAccount.name }}
{{- else }}
{{- default "default" .Values.serviceAccount.name }}
{{- end }}
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
{{- include "redlock-sidecar.imageRef" (dict "repository" .Values.image.repository "tag" (default .Chart.AppVersion .Values.image.tag) "digest" .Values.image.digest) }}
{{- end }}

{{- define "redlock-sidecar.lockName" -}}
{{- default (include "redlock-sidecar.fullname" .) .Values.lock.name }}
{{- end }}

{{- define "redlock-sidecar.cronJobName" -}}
{{- default (include "redlock-sidecar.suffixedName" (dict "root" . "suffix" "cron" "max" 52)) .Values.cronjob.name }}
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
{{- if .Values.redis.existingSecret }}
{{- .Values.redis.existingSecret }}
{{- else if .Values.redis.deploy.enabled }}
{{- include "redlock-sidecar.suffixedName" (dict "root" . "suffix" "redis-auth") }}
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
Checks of combinations the schema cannot express. Included once from every template that renders pods.
*/}}
{{- define "redlock-sidecar.validate" -}}
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
{{- end }}

{{/*
The CronJob's values: the same lock name and time zone in every cluster, and deadlines that fit the schedule.
*/}}
{{- define "redlock-sidecar.validateCronJob" -}}
{{- $c := .Values.cronjob }}
{{- if not $c.timeZone }}
{{- fail "cronjob.timeZone is required (e.g. Etc/UTC): every cluster running this job must use the same time zone, or their schedule slots differ" }}
{{- end }}
{{- if not $c.lockName }}
{{- fail "cronjob.lockName is required: every cluster running this job must use the same lock name, so it is not derived from the release" }}
{{- end }}
{{- if and $c.lockPerScheduleSlot (not $c.name) }}
{{- fail "cronjob.lockPerScheduleSlot needs cronjob.name: the Job name (<cronjob>-<slot>) is part of the lock name, so the CronJob must have the same name in every cluster" }}
{{- end }}
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
{{- define "redlock-sidecar.redisNodeName" -}}
{{- include "redlock-sidecar.suffixedName" (dict "root" .root "suffix" (printf "redis-%d" (int .index)) "max" 52) }}
{{- end }}

{{- define "redlock-sidecar.redisUrls" -}}
{{- $urls := list }}
{{- if .Values.redis.deploy.enabled }}
{{- range $i := until (int .Values.redis.deploy.nodes) }}
{{- $node := include "redlock-sidecar.redisNodeName" (dict "root" $ "index" $i) }}
{{- $urls = append $urls (printf "redis://%s-0.%s.%s.svc:%d" $node $node $.Release.Namespace (int $.Values.redis.deploy.port)) }}
{{- end }}
{{- else }}
{{- range .Values.redis.urls }}
{{- $urls = append $urls (ternary (regexReplaceAll "^redis(\\+sentinel)?://" . "rediss${1}://") . $.Values.redis.tls.enabled) }}
{{- end }}
{{- end }}
{{- join "," $urls }}
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
{{- with .Values.lock.renewInterval }}
- name: REDLOCK_RENEW_INTERVAL
  value: {{ . | quote }}
{{- end }}
- name: REDLOCK_SAFETY_MARGIN
  value: {{ .Values.lock.safetyMargin | quote }}
- name: REDLOCK_NODE_TIMEOUT
  value: {{ .Values.lock.nodeTimeout | quote }}
- name: REDLOCK_RETRY_DELAY
  value: {{ .Values.lock.retryDelay | quote }}
- name: REDLOCK_LOG_FORMAT
  value: {{ .Values.sidecar.logFormat | quote }}
{{- end }}

{{/*
Mounts and volumes of the Redis password file and TLS files (CA, client certificate and key), for
every container that connects to Redis. Files, not environment variables: guard's CMD inherits
the environment.
*/}}
{{- define "redlock-sidecar.redisClientVolumeMounts" -}}
{{- if (include "redlock-sidecar.redisSecret" .) }}
- name: redis-auth
  mountPath: /etc/redlock/redis-auth
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
{{- with .Values.affinity }}
affinity:
  {{- toYaml . | nindent 2 }}
{{- end }}
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
