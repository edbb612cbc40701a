{{/*
Monitoring: labels of the PodMonitor, ServiceMonitor and PrometheusRule (with the labels the
Prometheus selects them by), and the relabeling that marks a must-always-lead lock.
*/}}
{{- define "redlock-sidecar.monitoringLabels" -}}
{{ include "redlock-sidecar.labels" (dict "root" .) }}
{{- with .Values.monitoring.selectorLabels }}
{{ toYaml . }}
{{- end }}
{{- end }}

{{- define "redlock-sidecar.mustLeadRelabeling" -}}
{{- if .Values.monitoring.mustAlwaysLead }}
relabelings:
  - action: replace
    targetLabel: redlock_must_lead
    replacement: "true"
{{- end }}
{{- end }}
