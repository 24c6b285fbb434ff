from django import forms
from django.conf import settings

from .models import phone_number


class BookingForm(forms.Form):
    """What a customer types. Whether the seat is free is the database's to say (at commit),
    so it is not checked here: ``book_seat`` turns a taken seat into an error of this form."""

    seat = forms.IntegerField(min_value=1, max_value=settings.CINEMA_SEATS)
    phone = forms.CharField(max_length=16, validators=[phone_number])
