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

{{- define "redlock-sidecar.image" -}}
{{- printf "%s:%s" .Values.image.repository (default .Chart.AppVersion .Values.image.tag) }}
{{- end }}

{{- define "redlock-sidecar.lockName" -}}
{{- default (include "redlock-sidecar.fullname" .) .Values.lock.name }}
{{- end }}

{{- define "redlock-sidecar.cronLockName" -}}
{{- default (printf "%s-cron" (include "redlock-sidecar.fullname" .)) .Values.cronjob.lockName }}
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
{{- end }}

{{/*
Redis nodes
*/}}
{{- define "redlock-sidecar.redisNodeName" -}}
{{- printf "%s-redis-%d" (include "redlock-sidecar.fullname" .root) (int .index) }}
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
{{- $urls = append $urls (ternary (regexReplaceAll "^redis://" . "rediss://") . $.Values.redis.tls.enabled) }}
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
{{- with .Values.redis.existingSecret }}
- name: REDLOCK_REDIS_PASSWORD
  valueFrom:
    secretKeyRef:
      name: {{ . }}
      key: {{ $.Values.redis.passwordKey }}
{{- end }}
{{- if .Values.redis.tls.caSecret }}
- name: REDLOCK_REDIS_CA_FILE
  value: /etc/redlock/redis-ca/{{ .Values.redis.tls.caKey }}
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

{{- define "redlock-sidecar.caVolumeMounts" -}}
{{- if .Values.redis.tls.caSecret }}
- name: redis-ca
  mountPath: /etc/redlock/redis-ca
  readOnly: true
{{- end }}
{{- end }}

{{- define "redlock-sidecar.caVolumes" -}}
{{- with .Values.redis.tls.caSecret }}
- name: redis-ca
  secret:
    secretName: {{ . }}
{{- end }}
{{- end }}

{{/*
Pod-level settings of every pod that runs the sidecar or guard. Takes a dict {root, kubernetesApi}.
*/}}
{{- define "redlock-sidecar.podSettings" -}}
serviceAccountName: {{ include "redlock-sidecar.serviceAccountName" .root }}
automountServiceAccountToken: {{ .kubernetesApi }}
terminationGracePeriodSeconds: {{ .root.Values.terminationGracePeriodSeconds }}
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
  livenessProbe:
    httpGet:
      path: /healthz
      port: admin
    periodSeconds: 10
    timeoutSeconds: 2
    failureThreshold: 3
  readinessProbe:
    httpGet:
      path: /readyz
      port: admin
    periodSeconds: 5
    timeoutSeconds: 2
    failureThreshold: 2
  resources:
    {{- toYaml .Values.sidecar.resources | nindent 4 }}
  securityContext:
    {{- toYaml .Values.securityContext | nindent 4 }}
  {{- with (include "redlock-sidecar.caVolumeMounts" .) }}
  volumeMounts:
    {{- . | trim | nindent 4 }}
  {{- end }}
{{- end }}
